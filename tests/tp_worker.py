"""Run under torchrun with 2 processes: forward + backward of tp=2 models, results saved per rank.

Usage: torchrun --nproc_per_node 2 tests/tp_worker.py OUT_DIR ENCODING [ENCODING ...]

ENCODING:columns puts TUPE-A's positional term into q/k columns, as on CUDA
(positional.untied_as_columns).
"""

from unittest import mock

import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import tupe_ds
from tp_inputs import inputs
from tupe_ds.model import positional
from tupe_ds.parallel import end_distributed


def gather_shards(param):
    """The full tensor of a tensor-parallel parameter's gradient."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.grad
    shards = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, param.grad.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=param.partition_dim)


def main(out_dir, encodings):
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    for name in encodings:
        encoding, _, layout = name.partition(":")
        torch.manual_seed(0)
        model = tupe_ds.build_model("tiny", pos_encoding=encoding, tensor_parallel_size=2,
                                    hidden_dropout=0.0, attention_dropout=0.0)
        ids, mask, labels = inputs()
        columns = (lambda device: True) if layout == "columns" else positional.untied_as_columns
        with mock.patch.object(positional, "untied_as_columns", columns):
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
