"""Checkpoints that survive preemption, on top of DeepSpeed's save_checkpoint/load_checkpoint.

Every rank of every node writes into one shared folder, CHECKPOINTS/stepN: DeepSpeed's files,
then its random state `rng_rank{R}.pt` (last, so that it marks the rank's files as written), and
rank 0 the layout that wrote it (`layout.json`, read when resuming on another layout: reshard.py).
A checkpoint is complete when every rank's files are there: only then does rank 0 point the
`latest` file at it (written atomically), so a save cut short by a kill, on any node, is never
resumed from. Incomplete folders newer than `latest` are removed at start; complete ones beyond
the newest K are removed after each save.
"""

import os
import re
import shutil
import signal
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state, tensor_parallel

from tupe_ds.files import write_atomically
from tupe_ds.parallel import seed_tensor_parallel_rng
from tupe_ds.train import reshard
from tupe_ds.train.waits import announced

TAG = re.compile(r"^step(\d+)$")
VISIBLE_WITHIN_SECONDS = 120  # a shared filesystem shows another node's new files within this


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


def save(engine, directory: str, step: int, client_state: dict, keep: int,
         layout: reshard.SavedLayout) -> None:
    """Collective: every rank calls it."""
    tag, rank = tag_of(step), dist.get_rank()
    folder = os.path.join(directory, tag)
    with announced(f"every rank to write checkpoint {tag}", rank):  # DeepSpeed's barriers too
        engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)
        torch.save(rng_state(), os.path.join(folder, f"rng_rank{rank}.pt"))
        if rank == 0:
            write_atomically(os.path.join(folder, reshard.LAYOUT_FILE), layout.to_json())
        dist.barrier()
    if rank == 0:
        wait_until_visible(folder, [reshard.LAYOUT_FILE] + [
            f"rng_rank{r}.pt" for r in range(dist.get_world_size())])
        write_atomically(os.path.join(directory, "latest"), tag)
        for old in saved_steps(directory)[:-keep]:
            shutil.rmtree(os.path.join(directory, tag_of(old)), ignore_errors=True)
        reshard.remove_conversions_before(directory, step)
    dist.barrier()


def wait_until_visible(folder: str, names: list) -> None:
    """Every rank has written its files (the barrier); on a shared filesystem another node's new
    files may show here a little later. `latest` moves only once all of them are seen."""
    deadline = time.monotonic() + VISIBLE_WITHIN_SECONDS
    while True:
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{folder}: {', '.join(missing[:8])} not there "
                               f"{VISIBLE_WITHIN_SECONDS} s after every rank wrote its files; "
                               "is the checkpoint folder on a filesystem every node shares?")
        time.sleep(0.5)


def resume(engine, directory: str, plan: Optional[reshard.Reshard], seed: int):
    """The client state of the latest complete checkpoint, loaded into `engine`, or None. On a
    new layout (`plan`), through DeepSpeed's universal checkpoint when ZeRO shards are in it."""
    rank = dist.get_rank()
    if rank == 0:
        remove_incomplete(directory)
    dist.barrier()
    tag = latest_tag(directory)
    if tag is None:
        return None
    load_dir = directory
    if plan is not None:
        if tag != plan.tag:
            raise RuntimeError(f"{directory}/latest moved from {plan.tag} to {tag} since the "
                               "run started: another run writes into this folder")
        if plan.convert:
            if rank == 0:
                seconds = reshard.convert(directory, tag)
                print(f"tupe-pretrain: checkpoint {tag} was written by {plan.saved}; converted "
                      f"for {dist.get_world_size()} processes with DeepSpeed's universal "
                      f"checkpoint into {reshard.universal_dir(directory)}/{tag} "
                      f"({'reused' if seconds == 0 else f'{seconds:.1f} s'})", flush=True)
            with announced(f"rank 0 to convert checkpoint {tag} for this layout", rank):
                dist.barrier()
            load_dir = reshard.universal_dir(directory)
        elif rank == 0:
            print(f"tupe-pretrain: checkpoint {tag} was written by {plan.saved}; its optimizer "
                  "state is not partitioned and loads as it is", flush=True)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if path is None:
        raise RuntimeError(f"{load_dir}/{tag}: DeepSpeed could not load this checkpoint")
    if plan is not None and plan.convert:
        place_optimizer_state(engine)
    if plan is None:
        set_rng_state(torch.load(os.path.join(directory, tag, f"rng_rank{rank}.pt"),
                                 weights_only=False))
    else:  # the old ranks' streams belong to the old layout
        derive_rng_state(seed, client_state["step"], parallel_state.get_data_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_tensor_model_parallel_rank())
    return client_state


def place_optimizer_state(engine) -> None:
    """A universal load sets Adam's step as a CPU tensor, where torch's fused AdamW (the shipped
    configs') keeps it on the parameters' device; torch's own load_state_dict puts every state
    where its optimizer wants it (not measured on a GPU yet: on a CPU the two places are one)."""
    optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's, under ZeRO's wrapper
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(optimizer.state_dict())


def rng_state() -> dict:
    """This rank's random generators (dropout), so that a resumed run draws what it would have:
    the default ones (hidden dropout) and the tensor-parallel one (its heads' attention dropout)."""
    accelerator = get_accelerator()
    on_device = accelerator.device_name() != "cpu"
    return {"cpu": torch.get_rng_state(),
            "accelerator": accelerator.get_rng_state() if on_device else None,
            "tensor_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}


def derive_rng_state(seed: int, step: int, dp_rank: int, pp_rank: int, tp_rank: int) -> None:
    """Generators seeded from (seed, step, data-parallel rank, stage): a resumed run on a new
    layout has ranks that did not exist, and old ranks that now draw for other samples. As at a
    run's start, the default generators agree across the tensor-parallel ranks (hidden dropout)
    and the tensor-parallel generator differs (each rank's heads)."""
    derived = int(np.random.SeedSequence([seed, step, dp_rank, pp_rank]).generate_state(1)[0])
    torch.manual_seed(derived)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.manual_seed(derived)
    seed_tensor_parallel_rng(derived, tp_rank)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["accelerator"] is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    if "tensor_parallel" in state:  # not in checkpoints of earlier versions: seeded anew then
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tensor_parallel"])


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
