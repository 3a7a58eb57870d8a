"""Loading the chosen checkpoint into the engine: its DeepSpeed state (through a universal
checkpoint on a new layout) and each rank's random generators (`rng_rankR.pt`, so that a resumed
run draws the dropout it would have drawn; on a new layout, derived from (seed, step, rank)),
every rank the same checkpoint."""

import logging
import os
import socket
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state, tensor_parallel

from tupe_ds.distributed.parallel import seed_tensor_parallel_rng
from tupe_ds.tools.errors import Refused
from tupe_ds.train.checkpoint import manifest, reads, reshard, safe_load
from tupe_ds.train.progress import processes
from tupe_ds.tools.waits import announced

logger = logging.getLogger(__name__)


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


def confirm_loaded(tag: str, step: int) -> None:
    """Collective: every rank loaded the same checkpoint (its tag and the step it holds)."""
    every_rank = reads.gathered(lambda: (tag, step, socket.gethostname()),
                                f"every rank to confirm the checkpoint it loaded, {tag}")
    if len({(t, s) for t, s, _ in every_rank}) > 1:
        raise Refused("the ranks loaded different checkpoints: " + "; ".join(
            f"rank {rank} on {host}: {t} (step {s})"
            for rank, (t, s, host) in enumerate(every_rank)))


def load(engine, plan, seed: int) -> dict:
    """Collective: the client state of the chosen checkpoint, loaded into `engine` (through
    DeepSpeed's universal checkpoint on a new layout with ZeRO shards)."""
    rank, tag, step_dir = dist.get_rank(), plan.tag, os.path.join(plan.directory, plan.tag)
    resharding = plan.resharding
    converted = resharding is not None and resharding.convert
    load_dir = reshard.universal_dir(plan.directory) if converted else plan.directory
    if converted:
        if rank == 0:
            seconds = reshard.convert(plan.directory, tag)
            logger.info(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; "
                        f"converted for {processes(dist.get_world_size())} with DeepSpeed's "
                        f"universal checkpoint into {load_dir}/{tag} "
                        f"({'reused' if seconds == 0 else f'{seconds:.1f} s'})")
        with announced(f"rank 0 to convert checkpoint {tag} for this layout", rank):
            dist.barrier()
    elif resharding is not None and rank == 0:
        logger.info(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; its "
                    "optimizer state is not partitioned and loads as it is")
    schedule, loaded = holds_schedule(step_dir), {}

    def load_here():
        try:
            loaded["path"], loaded["state"] = engine.load_checkpoint(
                load_dir, tag=tag, load_lr_scheduler_states=schedule)
        except OSError as error:  # verified a moment ago: the filesystem's, not the checkpoint's
            raise reads.Unreadable.reading(error.filename or os.path.join(load_dir, tag),
                                           error) from None
        if resharding is None:
            load_rng_state(os.path.join(step_dir, file_name(rank)), root=step_dir)

    # no rank goes on to a collective before every rank's load is known to have read
    reads.gathered(load_here, f"every rank to load checkpoint {tag}")
    if loaded["path"] is None:
        raise RuntimeError(f"{load_dir}/{tag}: DeepSpeed could not load this checkpoint")
    client_state = loaded["state"]
    confirm_loaded(tag, client_state["step"])
    if converted:
        # a universal load sets Adam's step on the CPU, where fused AdamW keeps it on the device;
        # torch's load_state_dict puts every state where its optimizer wants it
        optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's, under ZeRO's wrapper
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.load_state_dict(optimizer.state_dict())
    if resharding is not None:  # the old ranks' streams belong to the old layout
        derive_rng_state(seed, client_state["step"], parallel_state.get_data_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_tensor_model_parallel_rank())
    return client_state


def holds_schedule(step_dir: str) -> bool:
    """Whether the checkpoint holds a scheduler's state (a run with a constant rate has none:
    schedule.follow_step takes its place)."""
    training = manifest.read(step_dir).get("training")
    return training is None or (training.get("scheduler") or {}).get("type") is not None
