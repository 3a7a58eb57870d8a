"""Loading the chosen checkpoint into the engine: its DeepSpeed state (through a universal
checkpoint on a new layout) and each rank's random streams, every rank the same checkpoint."""

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tupe_ds.tools.files import regular_file
from tupe_ds.train.checkpoint import manifest, reads, reshard
from tupe_ds.train.checkpoint.resume import ResumePlan
from tupe_ds.train.checkpoint.rng import derive_rng_state, file_name, load_rng_state
from tupe_ds.train.flags import Refused
from tupe_ds.train.waits import announced


def confirm_loaded(tag: str, step: int) -> None:
    """Collective: every rank loaded the same checkpoint (its tag and the step it holds)."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, (tag, step, socket.gethostname()))
    if len({(t, s) for t, s, _ in every_rank}) > 1:
        raise Refused("the ranks loaded different checkpoints: " + "; ".join(
            f"rank {rank} on {host}: {t} (step {s})"
            for rank, (t, s, host) in enumerate(every_rank)))


def load(engine, plan: ResumePlan, seed: int) -> dict:
    """Collective: the client state of the chosen checkpoint, loaded into `engine`. On a new
    layout, through DeepSpeed's universal checkpoint when ZeRO shards are in it."""
    rank, tag, directory = dist.get_rank(), plan.tag, plan.directory
    load_dir, resharding = directory, plan.resharding
    if resharding is not None:
        if resharding.convert:
            if rank == 0:
                seconds = reshard.convert(directory, tag)
                print(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; "
                      f"converted for {dist.get_world_size()} processes with DeepSpeed's "
                      f"universal checkpoint into {reshard.universal_dir(directory)}/{tag} "
                      f"({'reused' if seconds == 0 else f'{seconds:.1f} s'})", flush=True)
            with announced(f"rank 0 to convert checkpoint {tag} for this layout", rank):
                dist.barrier()
            load_dir = reshard.universal_dir(directory)
        elif rank == 0:
            print(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; its "
                  "optimizer state is not partitioned and loads as it is", flush=True)
    schedule = not plan.verified or holds_schedule(os.path.join(directory, tag))
    loaded = {}

    def load_here():
        try:
            loaded["path"], loaded["state"] = engine.load_checkpoint(
                load_dir, tag=tag, load_lr_scheduler_states=schedule)
        except OSError as error:  # verified a moment ago: the filesystem's, not the checkpoint's
            raise reads.Unreadable.reading(error.filename or os.path.join(load_dir, tag),
                                           error) from None
        if resharding is None:
            step_dir = os.path.join(directory, tag)
            rng_path = os.path.join(step_dir, file_name(rank))
            reads.retried(rng_path, lambda: load_rng_state(regular_file(rng_path, step_dir)))

    # no rank goes on to a collective before every rank's load is known to have read
    reads.gathered(load_here, f"every rank to load checkpoint {tag}")
    if loaded["path"] is None:
        raise RuntimeError(f"{load_dir}/{tag}: DeepSpeed could not load this checkpoint")
    client_state = loaded["state"]
    confirm_loaded(tag, client_state["step"])
    if resharding is not None and resharding.convert:
        place_optimizer_state(engine)
    if resharding is not None:  # the old ranks' streams belong to the old layout
        derive_rng_state(seed, client_state["step"], parallel_state.get_data_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_tensor_model_parallel_rank())
    return client_state


def holds_schedule(step_dir: str) -> bool:
    """Whether the checkpoint holds a scheduler's state: one of a run without a scheduler (a
    constant rate) does not, and the schedule of a run resuming or branching from it takes its
    place from the step (schedule.follow_step)."""
    training = manifest.read(step_dir).get("training")
    return training is None or (training.get("scheduler") or {}).get("type") is not None


def place_optimizer_state(engine) -> None:
    """A universal load sets Adam's step as a CPU tensor, where torch's fused AdamW (the shipped
    configs') keeps it on the parameters' device; torch's own load_state_dict puts every state
    where its optimizer wants it (not measured on a GPU yet: on a CPU the two places are one)."""
    optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's, under ZeRO's wrapper
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(optimizer.state_dict())
