"""--micro-batch auto: the largest micro-batch that divides each rank's share of the global batch
and fits in memory, found at a run's first start by probing the model the run then trains.
One probe: micro_batch_probe.py; the search over the sizes and its texts: micro_batch_search.py.

OUT/run.json records the choice with the layout it was made for (models, objective, the split of
the work, the device); a later start that resumes a checkpoint of the run on the same layout
keeps it without probing; a start with no checkpoint behind the choice (its first step ran out
of memory, or the folder held another model) or on another layout probes again and says why. An
explicit --micro-batch N skips all of this. With --pp > 1 `auto` is refused before any work
(ds_config.py): a pipeline stage's memory depends on the micro-batches its schedule holds.
"""

import dataclasses
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from tupe_ds.tools.errors import Refused
from tupe_ds.train import run_description
from tupe_ds.train.ds_config import micro_batch_candidates, with_micro_batch
from tupe_ds.train.micro_batch_probe import (GIB, HEADROOM, DeviceMemory, HostMemory,
                                             model_state_bytes, random_state_kept,
                                             synthetic_batch, training_pass)
from tupe_ds.train.micro_batch_search import (Probe, agreed, largest_fitting, nothing_fits,
                                              search_text)


def probed_choice(run, model, objective, device: torch.device,
                  limit: Optional[float] = None) -> dict:
    """The largest micro-batch that fits on every rank, as run.json records it; Refused when
    none does. `limit`: the bytes a process may use, in place of what its memory allows."""
    meter = HostMemory(HEADROOM) if device.type == "cpu" else DeviceMemory(device, HEADROOM)
    budget = meter.budget if limit is None else limit
    states = model_state_bytes(model, run.ds_config.get("zero_optimization", {}), run.dp_size)
    sizes = micro_batch_candidates(run.batch_split.global_batch, run.dp_size, run.batch_split.ramp)

    def probe(micro_batch: int) -> Probe:
        batch = synthetic_batch(run, objective, micro_batch)
        try:
            needed = meter.peak(lambda: training_pass(model, objective, batch, device)) + states
        except torch.OutOfMemoryError:
            needed = math.inf
        # outside the handler: its traceback holds the pass's tensors until it ends
        model.zero_grad(set_to_none=True)
        meter.empty_cache()
        return agreed(micro_batch, needed, budget, device)

    started = time.perf_counter()
    model.train()
    with random_state_kept(device), torch.compiler.set_stance("force_eager"):
        chosen, made = largest_fitting(sizes, probe)
    if chosen < 0:
        raise Refused(nothing_fits(made[0], states, meter.where, run))
    return {"micro_batch": sizes[chosen],
            "why": search_text(sizes, chosen, made, meter.where, run,
                               time.perf_counter() - started),
            "probes": [[p.micro_batch, None if math.isinf(p.needed) else int(p.needed)]
                       for p in made],
            "budget_bytes": int(made[0].budget), "headroom": HEADROOM}


def layout_of(run, device: torch.device) -> dict:
    """What a choice depends on: the models and objective, and how the work is split."""
    ramp = run.batch_split.ramp
    return {"world_size": run.world_size, "tp": run.layout.tp, "pp": run.layout.pp,
            "global_batch": run.batch_split.global_batch, "seq_len": run.seq_len,
            "zero_stage": run.ds_config.get("zero_optimization", {}).get("stage", 0),
            "precision": run.models[0].dtype, "rampup_batch_size": str(ramp) if ramp else None,
            "device": device_name(device), "objective": run.objective,
            "models": [dataclasses.asdict(config) for config in run.models]}


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    total = torch.accelerator.get_memory_info(device)[1]
    name = torch.get_device_module(device.type).get_device_name(device)
    return f"{name}, {total / GIB:.0f} GiB"


def recorded(out: str) -> Optional[dict]:
    """The auto choice OUT/run.json records (None: none, or no readable run.json)."""
    try:
        entry = run_description.read(out).get("micro_batch")
    except ValueError:
        return None
    auto = entry.get("auto") if isinstance(entry, dict) else None
    if not (isinstance(auto, dict) and type(auto.get("micro_batch")) is int
            and isinstance(auto.get("layout"), dict) and isinstance(auto.get("why"), str)):
        return None
    return auto


def kept_everywhere(micro_batch: int, device: torch.device) -> bool:
    """Whether every rank keeps the same recorded micro-batch (0: this rank keeps none)."""
    figures = torch.tensor([micro_batch, -micro_batch], dtype=torch.int64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures[0].item() == -figures[1].item() > 0


def not_kept_because(before: dict, layout: dict, run) -> str:
    """Why run.json's choice is not this start's ("" where it is): a choice is kept when the run
    resumes a checkpoint of its own, trained at that size, on the layout it was made for."""
    split = run.batch_split
    if not (run.resume_plan is not None and run.resume_plan.candidates):
        return (f"run.json's choice of {before['micro_batch']} has no checkpoint of this run "
                "behind it (a first step that ran out of memory, another model)")
    if before["layout"] != layout:
        return (f"the layout changed since run.json's choice of {before['micro_batch']} "
                f"({changes(before['layout'], layout)})")
    if before["micro_batch"] not in micro_batch_candidates(split.global_batch, split.dp,
                                                           split.ramp):
        return (f"run.json's choice of {before['micro_batch']} does not divide each rank's "
                f"{split.global_batch // split.dp} samples")
    return ""


def changes(before: dict, now: dict) -> str:
    return ", ".join("the models" if name == "models" else
                     f"{name} {before.get(name)} -> {value}" for name, value in now.items()
                     if before.get(name) != value)


def settled(run, model, objective, device: torch.device, limit: Optional[float] = None):
    """`run` with its micro-batch chosen where it is `auto`: kept from run.json for the same
    layout, else probed on `model` (the model the engine then gets); the same on every rank, and
    written into run.ds_config for DeepSpeed. Refused when nothing fits. `limit`: see
    probed_choice."""
    split = run.batch_split
    if split.micro_batch is not None:
        return run
    layout = layout_of(run, device)
    before = recorded(run.out)
    not_kept = before is not None and not_kept_because(before, layout, run)
    if kept_everywhere(before["micro_batch"] if before and not not_kept else 0, device):
        choice, note = before, f"auto, kept from run.json for this layout: {before['why']}"
    else:
        choice = {**probed_choice(run, model, objective, device, limit), "layout": layout}
        note = f"auto: {choice['why']}"
        if not_kept:
            note += f"; probed again: {not_kept}"
    return dataclasses.replace(run, batch_split=with_micro_batch(
        run.ds_config, split, choice["micro_batch"], note, auto=choice))
