"""Run under torchrun with 2 processes: forward + backward of tp=2 models, results saved per rank.

Usage: torchrun --nproc_per_node 2 tests/support/tp_worker.py OUT_DIR ENCODING [ENCODING ...]

ENCODING:columns puts TUPE-A's positional term into q/k columns, as on CUDA
(ModelConfig.untied_as_columns); the name `dropout` saves what each rank's dropout drew instead.
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import tupe_ds
from tp_inputs import inputs
from tupe_ds.distributed.parallel import end_distributed
from tupe_ds.model.kernel_layout import MaskedAttention
from tupe_ds.tools import startup


def gather_shards(param):
    """The full tensor of a tensor-parallel parameter's gradient."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.grad
    shards = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, param.grad.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=param.partition_dim)


def dropout_draws(p=0.5) -> dict:
    """Attention-dropout masks of layer 0's heads on this rank, read off uniform attention over
    one-hot values (the output is mask / (n (1 - p))), and the encoder's output in training mode,
    which hidden dropout (outside the tensor-parallel region) must make equal on every rank."""
    torch.manual_seed(0)
    model = tupe_ds.build_model("tiny", pos_encoding="tupe-r", tensor_parallel_size=2,
                                hidden_dropout=p, attention_dropout=p)
    model.train()
    attention = model.encoder.block.layers[0].self_attention.core_attention
    n, b, heads, d = 16, 8, 2, 16  # tiny: 4 heads of 16, 2 per rank; n = d for one-hot values
    zeros = torch.zeros(n, b, heads, d)
    one_hot = torch.eye(n).view(n, 1, 1, d).expand(n, b, heads, d)
    context = attention(zeros, zeros, one_hot, attention_bias=MaskedAttention())
    masks = context.view(n, b, heads, d) * (n * (1 - p))  # [i, b, head, j]: 0 or 1
    encoder_out = []
    model.encoder.register_forward_hook(lambda module, args, out: encoder_out.append(out.detach()))
    ids, mask, labels = inputs()
    model(ids, mask, labels)
    model.eval()
    model(ids, mask, labels)
    return {"attention_masks": masks.detach(), "encoder_output": encoder_out[0],
            "encoder_output_without_dropout": encoder_out[1]}


def main(out_dir, encodings):
    startup.resume_collector()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    for name in encodings:
        if name == "dropout":
            torch.save(dropout_draws(), os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            continue
        encoding, _, layout = name.partition(":")
        torch.manual_seed(0)
        model = tupe_ds.build_model("tiny", pos_encoding=encoding, tensor_parallel_size=2,
                                    hidden_dropout=0.0, attention_dropout=0.0,
                                    untied_as_columns=True if layout == "columns" else None)
        ids, mask, labels = inputs()
        loss, logits = model(ids, mask, labels)
        loss.backward()
        result = {
            "loss": loss.detach(),
            "logits": logits.detach(),
            "grads": {name: gather_shards(p) for name, p in model.named_parameters()},
        }
        if model.model_config.encoding.has_positional_logits:
            result["scores"] = model.positional_scores(16).detach()
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    end_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
