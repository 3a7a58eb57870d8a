"""The numbers of a comparison, from what its runs left in OUT/runs/NAME (train_log.jsonl,
run.json, the checkpoints): each run's state and validation curve against steps, seconds and
FLOPs, the mean and band over seeds, and the race to the baseline's final validation loss."""

import itertools
import json
import os
import statistics

import numpy as np

from tupe_ds.compare.plan import Plan, Run
from tupe_ds.compare.recipes import Ramp
from tupe_ds.train.monitor import estimated_training_seconds


def read_log(run_dir: str) -> dict:
    """{step: entry} of a run's train_log.jsonl; a step logged again after a resume keeps the
    later values."""
    entries = {}
    path = os.path.join(run_dir, "train_log.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                entries.setdefault(entry["step"], {}).update(entry)
    return dict(sorted(entries.items()))


def read_description(run_dir: str):
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def training_time(entries: dict) -> tuple:
    """(logged steps, cumulative seconds of training at each): the log's
    time/training_seconds, which excludes evaluation, saves and each start's start-up, and
    which checkpoints carry over resumes. The lines an earlier tupe_ds wrote before it (a whole
    log, or the start of one resumed by this one) have no such field: their steps times the
    median of their seconds_per_step (train/monitor.py, estimated_training_seconds, which the
    resumed run started from too)."""
    timed = [step for step, e in entries.items() if "time/training_seconds" in e]
    first = timed[0] if timed else float("inf")
    older = {step: e["throughput/seconds_per_step"] for step, e in entries.items()
             if step < first and "throughput/seconds_per_step" in e}
    estimated = [estimated_training_seconds(older, step) for step in older]
    return ([*older, *timed],
            [*estimated, *(entries[step]["time/training_seconds"] for step in timed)])


def flops_by_step(description, steps: list) -> list:
    """The FLOPs of the first s steps for each s of `steps`: Megatron's count of a step at the
    full global batch (run.json's flops_per_step), per sample, times the samples they took; a
    batch ramp's smaller first batches (run.json's rampup_batch_size) counted as such."""
    if description is None:
        return [0.0] * len(steps)
    flops, global_batch = description["flops_per_step"], description["global_batch"]
    ramp = description.get("rampup_batch_size")
    if not ramp:
        return [step * flops for step in steps]
    start, increment, samples = map(int, str(ramp).split())
    ramped = list(Ramp(start, increment, samples, global_batch).batches())
    taken = [0, *itertools.accumulate(ramped)]  # samples of the first k ramp steps
    return [flops / global_batch * (taken[min(step, len(ramped))]
                                    + max(0, step - len(ramped)) * global_batch)
            for step in steps]


def run_record(plan: Plan, run: Run, status: dict) -> dict:
    """One run: its state and its validation curve against steps, seconds and FLOPs."""
    run_dir = plan.run_dir(run)
    entries = read_log(run_dir)
    description = read_description(run_dir)
    steps_done = plan.trained_steps(run)
    attempt = status.get(run.name)
    if steps_done >= plan.steps:
        state = "complete"
    elif attempt and attempt["exit"] != 0:
        state = f"failed (exit {attempt['exit']})"
    else:
        state = "not started" if description is None else "stopped"
    timed, elapsed = training_time(entries)
    valid = {step: e for step, e in entries.items() if "valid/loss" in e}
    valid_steps = list(valid)
    curve = {"step": valid_steps,
             "seconds": list(np.interp(valid_steps, [0, *timed], [0.0, *elapsed])) if timed
             else [0.0] * len(valid_steps),
             "flops": flops_by_step(description, valid_steps)}
    for name in sorted({k for e in valid.values() for k in e if k.startswith("valid/")}):
        curve[name[len("valid/"):]] = [valid[step].get(name) for step in valid_steps]
    return {"name": run.name, "encoding": run.encoding, "seed": run.seed, "state": state,
            "checkpoint_step": steps_done, "log": attempt["log"] if attempt else None,
            "training_seconds": elapsed[-1] if elapsed else None,
            "final_valid_loss": curve["loss"][-1] if valid_steps else None, "valid": curve}


def encoding_curve(records: list):
    """Mean, lowest and highest validation loss over the seeds at the steps all of them reached."""
    records = [r for r in records if r["valid"]["step"]]
    if not records:
        return None
    steps = sorted(set.intersection(*(set(r["valid"]["step"]) for r in records)))
    if not steps:
        return None
    at = [{key: dict(zip(r["valid"]["step"], r["valid"][key])) for key in ("loss", "seconds",
                                                                            "flops")}
          for r in records]
    losses = [[a["loss"][s] for a in at] for s in steps]
    return {"seeds": len(records), "step": steps,
            "mean": [statistics.fmean(v) for v in losses],
            "low": [min(v) for v in losses], "high": [max(v) for v in losses],
            "seconds": [statistics.fmean(a["seconds"][s] for a in at) for s in steps],
            "flops": [statistics.fmean(a["flops"][s] for a in at) for s in steps]}


def first_reaching(curve: dict, target: float):
    """(step, seconds) where the mean validation loss first is at or below `target`."""
    for step, loss, seconds in zip(curve["step"], curve["mean"], curve["seconds"]):
        if loss <= target:
            return step, seconds
    return None, None


def race_to_baseline(curves: dict, baseline: str) -> dict:
    """Steps (and time) each encoding takes to reach the baseline's final validation loss, and
    their share of the baseline's steps (the paper's "30% of the steps")."""
    base = curves.get(baseline)
    if base is None:
        return {"baseline": baseline, "target": None, "encodings": {}}
    target, base_step, base_seconds = base["mean"][-1], base["step"][-1], base["seconds"][-1]
    race = {}
    for encoding, curve in curves.items():
        step, seconds = first_reaching(curve, target)
        race[encoding] = {"step": step, "seconds": seconds,
                          "share_of_baseline_steps": step / base_step if step else None,
                          "share_of_baseline_time": seconds / base_seconds
                          if step and base_seconds else None}
    return {"baseline": baseline, "target": target, "baseline_step": base_step,
            "encodings": race}
