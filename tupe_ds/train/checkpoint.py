"""Checkpoints that survive preemption, on top of DeepSpeed's save_checkpoint/load_checkpoint.

A checkpoint is complete when every rank has written its files: only then does rank 0 point the
`latest` file at it (written atomically), so a save cut short by a kill is never resumed from.
Incomplete folders newer than `latest` are removed at start; complete ones beyond the newest K
are removed after each save.
"""

import os
import re
import shutil
import signal

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from tupe_ds.files import write_atomically

TAG = re.compile(r"^step(\d+)$")


def tag_of(step: int) -> str:
    return f"step{step}"


def latest_tag(directory: str):
    path = os.path.join(directory, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def saved_steps(directory: str) -> list:
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(TAG.match, os.listdir(directory)) if m)


def latest_step(directory: str) -> int:
    """The step of the latest complete checkpoint in `directory`; 0 when there is none."""
    latest = latest_tag(directory)
    return int(TAG.match(latest).group(1)) if latest else 0


def remove_incomplete(directory: str) -> None:
    """Rank 0, before resuming: folders of saves that never completed."""
    newest_complete = latest_step(directory)
    for step in saved_steps(directory):
        if step > newest_complete:
            shutil.rmtree(os.path.join(directory, tag_of(step)), ignore_errors=True)


def save(engine, directory: str, step: int, client_state: dict, keep: int) -> None:
    """Collective: every rank calls it."""
    engine.save_checkpoint(directory, tag=tag_of(step), client_state=client_state, save_latest=False)
    torch.save(rng_state(), os.path.join(directory, tag_of(step), f"rng_rank{dist.get_rank()}.pt"))
    dist.barrier()  # every rank's files are on disk
    if dist.get_rank() == 0:
        write_atomically(os.path.join(directory, "latest"), tag_of(step))
        for old in saved_steps(directory)[:-keep]:
            shutil.rmtree(os.path.join(directory, tag_of(old)), ignore_errors=True)
    dist.barrier()


def resume(engine, directory: str):
    """The client state of the latest complete checkpoint, loaded into `engine`, or None."""
    if dist.get_rank() == 0:
        remove_incomplete(directory)
    dist.barrier()
    tag = latest_tag(directory)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(directory, tag=tag)
    if path is None:
        raise RuntimeError(f"{directory}/{tag}: DeepSpeed could not load this checkpoint")
    set_rng_state(torch.load(os.path.join(directory, tag, f"rng_rank{dist.get_rank()}.pt"),
                             weights_only=False))
    return client_state


def rng_state() -> dict:
    """This rank's random generators (dropout), so that a resumed run draws what it would have."""
    accelerator = get_accelerator()
    return {"cpu": torch.get_rng_state(),
            "accelerator": accelerator.get_rng_state() if accelerator.device_name() != "cpu" else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["accelerator"] is not None:
        get_accelerator().set_rng_state(state["accelerator"])


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's warning before preemption) ask the run to save and stop.

    Every rank learns of a signal received by any rank at the next step boundary.
    """

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = signal.Signals(signum).name

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
