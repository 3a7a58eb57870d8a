"""Under a launcher, with tupe-pretrain's flags: train --steps steps as tupe_ds.train.loop does,
save a checkpoint, and save the live engine's masked-LM logits on a fixed batch (OUT/live_logits.pt)
for test_export.py to compare with the exported model's."""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tp_inputs import inputs
from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import (accelerator_device, end_distributed, gather_tensor_parallel,
                                          start_distributed)
from tupe_ds.train.checkpoint import history
from tupe_ds.train.checkpoint.save import save, saved_layout
from tupe_ds.train.config import load
from tupe_ds.train.datasets import datasets
from tupe_ds.train.engine import build_engine
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.run_folder.description import describe_run
from tupe_ds.tools import startup


def main(argv):
    startup.resume_collector()
    launch.discover()
    run = load(argv)
    start_distributed("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=run.layout.tp,
                                             pipeline_model_parallel_size=run.layout.pp)
    os.makedirs(run.out, exist_ok=True)
    if dist.get_rank() == 0:
        describe_run(run, lineage="test")
        history.append(run.out, [], [history.record("attempt", lineage="test")])  # its start's
    objective = OBJECTIVES[run.objective]
    device = accelerator_device()
    _, engine, steps = build_engine(run, objective, device)
    data = datasets(run, Vocabulary.from_data_dir(run.data), objective)
    batches = TrainBatches(data["train"], engine.train_micro_batch_size_per_gpu(),
                           engine.gradient_accumulation_steps(),
                           parallel_state.get_data_parallel_rank(), run.dp_size)
    for _ in range(run.steps):
        steps.train(batches.next_step(), {})
    save(engine, os.path.join(run.out, "checkpoints"), run.steps,
         {"step": run.steps, "consumed": batches.consumed}, keep=1,
         layout=saved_layout(run, engine), record={"lineage": "test", "identity": run.identity},
         device=device)

    ids, mask, labels = inputs(batch=3, n=40, vocab=1000)
    engine.eval()
    with torch.no_grad():
        if run.layout.pp > 1:
            engine.reset_activation_shape()  # not the training batches' shape
            _, logits = engine.eval_batch(iter([((ids, mask), labels)]), return_logits=True,
                                          num_micro_batches=1)
            writer = engine.is_last_stage()
            if writer:
                logits = gather_tensor_parallel(logits, dim=-1).transpose(0, 1)
        else:
            logits = engine(ids.to(device), mask.to(device))  # gathered over tp
            writer = True
    if writer and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        torch.save(logits.cpu(), os.path.join(run.out, "live_logits.pt"))
    steps.close()
    end_distributed()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")])
