"""Under torchrun, 2 processes: each builds the tiny model with its encoder compiled whole and
runs a training forward and backward; on rank 1 inductor fails (as on a node whose compiler or
GPU does not work). Each rank's log lines as tupe-pretrain shows them, then rank 0 prints the
run's compile summary."""

import os

import torch
import torch._inductor.compile_fx as inductor
import torch.distributed as dist

import tupe_ds
from tupe_ds.model import compiled
from tupe_ds.tools import log_lines
from test_attention import inputs


def fails(*args, **kwargs):
    raise RuntimeError("injected: no compiler on this node")


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log_lines.show(rank)
    if rank == 1:
        inductor._compile_fx_inner = fails
    torch.manual_seed(0)
    # test_compile.py's graph test compiles this model before, in the node's cache: a hit here
    model = tupe_ds.build_model("tiny", pos_encoding="bert-a", compile="block",
                                hidden_dropout=0.0, attention_dropout=0.0)
    loss, _ = model(*inputs(padded=True))
    loss.backward()
    said = compiled.summary(model)
    if rank == 0:
        print(f"summary: {said}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
