"""--lr-schedule: the learning rate of every optimizer step.

linear and cosine are DeepSpeed's WarmupDecayLR and WarmupCosineLR, named in the DeepSpeed
config as any DeepSpeed run names them. wsd (warmup-stable-decay, the trapezoid of ModernBERT and
Megatron-LM's --lr-decay-style WSD) is written here, on DeepSpeed's WarmupLR, as DeepSpeed has
none: the warmup is WarmupLR's, then the peak holds until the last --decay-steps of --steps,
which decay to the minimum linearly or as 1 - sqrt (Hägele et al. 2024).

All three count optimizer steps, whatever a batch ramp does to their size, and keep their place
in the scheduler's `last_batch_iteration`, which DeepSpeed's checkpoints hold: a resume, a new
layout and a decay branch (--init-from --branch) go on from the step they start at. DeepSpeed
steps its scheduler after each optimizer step: step k (from 1) runs with the rate for
last_batch_iteration k - 2, the warmup's minimum for the first two. It does not step it after a
step it skipped (a non-finite gradient, an fp16 overflow); `follow_step` counts those too, so
that every step has its own rate and a decay ends at --steps.
"""

import argparse
import math
from typing import Optional

import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.lr_schedules import WarmupLR

SCHEDULES = {
    "linear": "warmup, then a linear decay to the minimum at --steps (BERT's; DeepSpeed's "
              "WarmupDecayLR)",
    "cosine": "warmup, then a cosine decay to the minimum at --steps (DeepSpeed's "
              "WarmupCosineLR)",
    "wsd": "warmup, the peak held, then a decay over the last --decay-steps (warmup-stable-"
           "decay; a stable run's checkpoints can each start a decay branch)",
}
DECAY_SHAPES = ("linear", "1-sqrt")
WSD_TYPE = "WarmupStableDecayLR"  # how the DeepSpeed config's "scheduler" records it
SCHEDULE_NAMES = {"WarmupDecayLR": "linear", "WarmupCosineLR": "cosine", WSD_TYPE: "wsd"}


class WarmupStableDecayLR(WarmupLR):
    """DeepSpeed's WarmupLR, held at the peak until `decay_num_steps` before `total_num_steps`,
    then decayed to the minimum: linearly (the gamma of WarmupDecayLR over the decay alone) or
    as 1 - sqrt of the decay's progress."""

    def __init__(self, optimizer, total_num_steps: int, decay_num_steps: int,
                 decay_shape: str = "linear", warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "linear", last_batch_iteration: int = -1):
        if decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape {decay_shape!r}: one of {', '.join(DECAY_SHAPES)}")
        self.total_num_steps, self.decay_num_steps = total_num_steps, decay_num_steps
        self.decay_shape = decay_shape
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        # the rate of step last_batch_iteration + 2 (module docstring), as Megatron-LM's and
        # transformers' WSD give it: the first step of the decay at the peak, the step after
        # the last at the minimum
        decayed = self.last_batch_iteration + 1 - (self.total_num_steps - self.decay_num_steps)
        progress = min(1.0, decayed / self.decay_num_steps)
        if progress <= 0:
            return 1.0
        return 1.0 - progress if self.decay_shape == "linear" else 1.0 - math.sqrt(progress)


def scheduler_config(args: argparse.Namespace, warmup: dict) -> dict:
    """The DeepSpeed config's "scheduler" for --lr-schedule over --steps, from `warmup`
    (peak_lr, min_lr, warmup_num_steps, warmup_type)."""
    name, peak, low = args.lr_schedule, warmup["peak_lr"], warmup["min_lr"]
    shared = {"total_num_steps": args.steps, "warmup_num_steps": warmup["warmup_num_steps"],
              "warmup_type": warmup["warmup_type"]}
    if name == "cosine":
        return {"type": "WarmupCosineLR",
                "params": {**shared, "warmup_min_ratio": low / peak,
                           "cos_min_ratio": warmup["cosine_end_ratio"]}}
    params = {**shared, "warmup_min_lr": low, "warmup_max_lr": peak}
    if name == "linear":
        return {"type": "WarmupDecayLR", "params": params}
    return {"type": WSD_TYPE, "params": {**params, "decay_num_steps": args.decay_steps,
                                         "decay_shape": args.decay_shape or "linear"}}


def config_warmup(ds_config: dict) -> dict:
    """The peak and minimum learning rates, the end of a cosine decay (as a share of the peak)
    and the warmup the config's scheduler (or, without one, its optimizer) gives: what
    --lr-schedule keeps when it changes the schedule's shape. The warmup's type defaults to
    DeepSpeed's (log) where the config names a scheduler."""
    scheduler = ds_config.get("scheduler") or {}
    params = scheduler.get("params", {})
    peak = params.get("warmup_max_lr", ds_config.get("optimizer", {}).get("params", {})
                      .get("lr", 1e-3))
    if "warmup_min_lr" in params:
        low = params["warmup_min_lr"]
    else:
        low = peak * params.get("warmup_min_ratio", 0.0)
    return {"peak_lr": peak, "min_lr": low,
            "cosine_end_ratio": params.get("cos_min_ratio", low / peak),
            "warmup_num_steps": params.get("warmup_num_steps", 0),
            "warmup_type": params.get("warmup_type", "log" if scheduler else "linear")}


def decay_room(steps: int, warmup_steps: int) -> int:
    """The most --decay-steps a wsd schedule of `steps` leaves at least one step at the peak
    with: WarmupLR's warmup (at least 2 steps) reaches it at step warmup + 2, and the decay's
    first step runs at the peak."""
    return steps - max(2, warmup_steps) - 1


def follow_step(lr_scheduler, step: int) -> None:
    """Before optimizer step `step` (from 1): the scheduler at that step's place, where DeepSpeed
    left it behind by the steps it skipped."""
    place = step - 2
    if getattr(lr_scheduler, "last_batch_iteration", place) != place:
        lr_scheduler.step(place)


def client_scheduler(ds_config: dict):
    """(the config DeepSpeed is given, the lr_scheduler argument of deepspeed.initialize): a
    WSD schedule is built here, as DeepSpeed does not know it; the others from the config."""
    scheduler = ds_config.get("scheduler") or {}
    if scheduler.get("type") != WSD_TYPE:
        return ds_config, None
    params = scheduler["params"]
    return ({k: v for k, v in ds_config.items() if k != "scheduler"},
            lambda optimizer: WarmupStableDecayLR(optimizer, **params))


def rate_at(scheduler: dict, step: int) -> float:
    """The learning rate optimizer step `step` (from 1) runs at under a DeepSpeed config's
    `scheduler` (None: the optimizer's constant rate, returned as nan: unknown here), stepped as
    the run's engine steps it."""
    if not scheduler:
        return math.nan
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    _, wsd = client_scheduler({"scheduler": scheduler})
    lr_scheduler = (wsd(optimizer) if wsd
                    else getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"]))
    follow_step(lr_scheduler, step)
    return optimizer.param_groups[0]["lr"]


def branch_rates(before: dict, step: int, after: dict) -> tuple:
    """(the rate checkpoint `step` ran its last step at under the schedule `before`, the rate
    of the next step under the branch's `after`)."""
    return rate_at(before, step), rate_at(after, step + 1)


def schedule_text(ds_config: dict) -> str:
    """The schedule in a few words, for the run's first line."""
    scheduler = ds_config.get("scheduler") or {}
    params = scheduler.get("params", {})
    name = SCHEDULE_NAMES.get(scheduler.get("type"), scheduler.get("type") or "constant")
    text = f"{name}, peak {config_warmup(ds_config)['peak_lr']:g}"
    if "warmup_num_steps" in params:
        text += f", {params['warmup_num_steps']} warmup steps"
    if scheduler.get("type") == WSD_TYPE:
        text += f", {params['decay_shape']} decay over the last {params['decay_num_steps']}"
    return text


def rates_differ(first: float, second: float) -> bool:
    """Whether two rates differ, both known (nan: a constant rate, not known here)."""
    return not (math.isnan(first) or math.isnan(second)
                or math.isclose(first, second, rel_tol=1e-6, abs_tol=1e-12))


def resume_rate_change(before: Optional[dict], step: int, after: Optional[dict]) -> str:
    """What a resume at checkpoint `step` moves of the rate of step `step` + 1: the schedule the
    checkpoint's steps ran under (`before`, its manifest's) against this command's (`after`),
    where another --steps moves a decay's end or a warmup cut to --steps; "" where the rate goes
    on (the same schedule, a constant rate, WSD's stable phase still at that step)."""
    old, new = rate_at(before, step + 1), rate_at(after, step + 1)
    if not rates_differ(old, new):
        return ""
    change = (f"step {step + 1} would run at learning rate {new:.4g}, not the {old:.4g} of the "
              f"schedule step {step} ran under")
    if (before or {}).get("type") == WSD_TYPE and (after or {}).get("type") == WSD_TYPE:
        began = before["params"]["total_num_steps"] - before["params"]["decay_num_steps"]
        begins = after["params"]["total_num_steps"] - after["params"]["decay_num_steps"]
        if began < step <= begins:  # begins == step: the decay's first step is the peak's
            change += (f": its decay began after step {began}, this one begins after step "
                       f"{begins}, and the rate goes back to the peak until then")
    return change


def ran_under(scheduler: Optional[dict]) -> str:
    """How to ask for `scheduler` again: its --steps, where its end follows them."""
    total = (scheduler or {}).get("params", {}).get("total_num_steps")
    return f"--steps {total}" if total is not None else "the --steps it ran under"
