"""Run under `deepspeed --num_gpus 2`: one SGD step of a 2-stage BertPipeline (2 layers per stage)
per encoding.

Usage: deepspeed --num_gpus 2 tests/support/pp_worker.py OUT_DIR ENCODING [ENCODING ...]

Each stage saves the loss, how often it computed the positional term, and its copies of the tied
parameters after the step, for test_pipeline.py to compare with one process.
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import os
import sys

import deepspeed
import torch
from megatron.core import parallel_state

from tp_inputs import micro_batches
from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import end_distributed, start_distributed
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.layers import masked_lm_loss
from tupe_ds.model.pipeline import BertPipeline, pipeline_topology
from tupe_ds.model.positional import PositionalEncoding
from tupe_ds.tools import startup

LR = 1.0  # large, so that a wrong gradient moves the weights visibly
MICRO_BATCHES = 2


def count_calls(method):
    def counted(self, *args, **kwargs):
        counted.calls += 1
        return method(self, *args, **kwargs)

    counted.calls = 0
    return counted


def main(out_dir, encodings):
    startup.resume_collector()
    launch.discover()
    start_distributed("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    PositionalEncoding.attention_bias = count_calls(PositionalEncoding.attention_bias)
    for encoding in encodings:
        config = ModelConfig.from_preset("tiny", num_layers=4, pos_encoding=encoding,
                                         hidden_dropout=0.0, attention_dropout=0.0)
        torch.manual_seed(0)
        model = BertPipeline(config, pipeline_topology(2, 1, 1),
                             loss_fn=lambda logits, labels: masked_lm_loss(logits, labels.t()))
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO_BATCHES,
                    "train_batch_size": 2 * MICRO_BATCHES, "gradient_clipping": 0.0,
                    "steps_per_print": 10**9})
        PositionalEncoding.attention_bias.calls = 0
        loss = engine.train_batch(iter([((ids, mask), labels)
                                        for ids, mask, labels in micro_batches(MICRO_BATCHES)]))
        tied = {f"{key}.{name}": param.detach().clone()
                for key, module in model.tied_modules.items()
                for name, param in module.named_parameters()}
        torch.save({"loss": loss.detach(), "positional_calls": PositionalEncoding.attention_bias.calls,
                    "tied": tied}, os.path.join(out_dir, f"{encoding}.stage{stage}.pt"))
    end_distributed()


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    main(arguments[0], arguments[1:])
