"""Each rank's random generators in a checkpoint (`rng_rankR.pt`), so that a resumed run draws
the dropout it would have drawn; on a new layout, generators derived from (seed, step, rank)."""

from typing import Optional

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from megatron.core import tensor_parallel

from tupe_ds.distributed.parallel import seed_tensor_parallel_rng
from tupe_ds.train.checkpoint import safe_load


def file_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def rng_state() -> dict:
    """This rank's generators: the default ones (hidden dropout), the tensor-parallel one."""
    accelerator = get_accelerator()
    on_device = accelerator.device_name() != "cpu"
    return {"cpu": torch.get_rng_state(),
            "accelerator": accelerator.get_rng_state() if on_device else None,
            "tensor_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}


def load_rng_state(path: str, root: Optional[str] = None) -> None:
    state = safe_load.load(path, root=root)
    torch.set_rng_state(state["cpu"])
    if state["accelerator"] is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tensor_parallel"])


def derive_rng_state(seed: int, step: int, dp_rank: int, pp_rank: int, tp_rank: int) -> None:
    """Generators seeded from (seed, step, data-parallel rank, stage), for a new layout: as at a
    run's start, the default ones agree across tensor-parallel ranks, theirs differ."""
    derived = int(np.random.SeedSequence([seed, step, dp_rank, pp_rank]).generate_state(1)[0])
    torch.manual_seed(derived)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.manual_seed(derived)
    seed_tensor_parallel_rng(derived, tp_rank)
