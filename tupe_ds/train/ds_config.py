"""A run's DeepSpeed config: the --ds-config file, checked against this machine and against
DeepSpeed's pipeline engine, with the command line's ZeRO stage, batch and schedule written in."""

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from tupe_ds.distributed.launch import processes_on_this_node
from tupe_ds.machine import doctor
from tupe_ds.tools.errors import CommandRefused
from tupe_ds.train import batch_ramp, normalization, precision
from tupe_ds.train.batch_ramp import RampSettings
from tupe_ds.train.checkpoint.same_run import training_settings
from tupe_ds.train.flags import MICRO_BATCH_AUTO, fail
from tupe_ds.train.schedule import SCHEDULE_NAMES, config_warmup, decay_room, scheduler_config


@dataclass(frozen=True)
class BatchSplit:
    """How a step's global batch is split: micro-batch x accumulation steps x data-parallel
    ranks; `note` says what the config logic changed or chose by itself ("" if nothing). Under
    --micro-batch auto, micro_batch and accumulation are None until the start chooses them
    (train/micro_batch.py), which `auto` then records."""
    global_batch: int
    micro_batch: Optional[int]
    accumulation: Optional[int]
    dp: int
    note: str = ""
    ramp: Optional[RampSettings] = None  # --rampup-batch-size
    auto: Optional[dict] = None  # --micro-batch auto's choice, as run.json records it

    def __str__(self) -> str:
        ramp = self.ramp
        micro = (f"micro-batch {self.micro_batch} x accumulation {self.accumulation}"
                 if self.micro_batch else "micro-batch auto")
        return (f"global batch {self.global_batch} = {micro} x dp {self.dp}"
                + (f", ramped up from {ramp.start} by {ramp.increment} over the first "
                   f"{ramp.samples} samples" if ramp else "")
                + (f" ({self.note})" if self.note else ""))


def given_by_config(args: argparse.Namespace) -> dict:
    """{dest: (value, where)} of the flags that override the --ds-config, as the file gives them
    (--print-config; {} when it does not read)."""
    try:
        config = doctor.read_ds_config(args.ds_config)
        warmup = config_warmup(config)
    except (CommandRefused, TypeError, ValueError, AttributeError):
        return {}
    scheduler = config.get("scheduler") or {}
    values = {"micro_batch": config.get("train_micro_batch_size_per_gpu"),
              "global_batch": config.get("train_batch_size"),
              "zero_stage": config.get("zero_optimization", {}).get("stage"),
              "lr": warmup["peak_lr"], "warmup_steps": warmup["warmup_num_steps"],
              "lr_schedule": SCHEDULE_NAMES.get(scheduler.get("type"))}
    if values["lr_schedule"] == "wsd" and args.lr_schedule is None:  # else --lr-schedule's
        params = scheduler.get("params") or {}
        values.update(decay_steps=params.get("decay_num_steps"),
                      decay_shape=params.get("decay_shape", "linear"))
    where = {dest: f"the --ds-config's, {args.ds_config}" for dest in values}
    # what the run makes of them, for as many processes as a launcher here says (else one)
    world = os.environ.get("WORLD_SIZE", "1")
    dp = max(1, int(world) // (args.tp * args.pp)) if world.isdigit() else 1
    batch, micro = args.global_batch or values["global_batch"], values["micro_batch"]
    if args.micro_batch is None and type(batch) is type(micro) is int and batch > 0 and (
            lowered := lowered_micro_batch(batch, micro, dp)):
        values["micro_batch"] = lowered
        where["micro_batch"] += (f": {micro}, lowered to the global batch {batch}'s share of "
                                 f"each of {dp} data-parallel rank(s)")
    warmup = values["warmup_steps"]
    if args.warmup_steps is None and args.steps and type(warmup) is int and warmup > args.steps:
        values["warmup_steps"] = args.steps
        where["warmup_steps"] += f": {warmup}, cut to --steps {args.steps}"
    return {dest: (value, where[dest]) for dest, value in values.items() if value is not None}


def deepspeed_config(args: argparse.Namespace, dp: int,
                     machine: doctor.Machine) -> Tuple[dict, str, BatchSplit, dict]:
    """The config the DeepSpeed engine gets for `dp` data-parallel ranks, its precision (fp32,
    fp16 or bf16), its batch split and its training settings (set_schedule); tupe-doctor's fatal
    findings on `machine` stop the run."""
    try:
        ds_config = doctor.read_ds_config(args.ds_config)
    except CommandRefused as error:  # tupe-pretrain's refusals are Refused
        fail(str(error))
    if args.bf16:
        refusal = precision.bf16_refusal(machine)
        if refusal:
            fail(refusal)
        ds_config = precision.with_bf16(ds_config)
    dtype = doctor.precision(ds_config)
    for finding in doctor.all_findings(machine, args.ds_config, processes_on_this_node(),
                                       ds_config=ds_config):
        if finding.fatal:
            fail(finding.text)
    if args.zero_stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    check_pipeline(args, ds_config, dtype)
    split = set_batch(args, ds_config, dp)
    training = set_schedule(args, ds_config)
    ds_config["tensorboard"] = {"enabled": True, "job_name": "deepspeed",
                                "output_path": os.path.join(args.out, "tensorboard")}
    ds_config.setdefault("steps_per_print", 10**9)
    # DeepSpeed's throughput timer synchronises the device twice a micro-batch (forward and
    # step; DeepSpeed PR #5363 cites 20-25% slower steps): off unless the config turns it on.
    # The log line gives samples/s (train/monitor.py).
    ds_config.setdefault("timers", {}).setdefault("throughput", {}).setdefault("enabled", False)
    return ds_config, dtype, split, training


def check_pipeline(args: argparse.Namespace, ds_config: dict, dtype: str) -> None:
    """What DeepSpeed's pipeline engine cannot do with this ZeRO stage and precision."""
    if args.pp == 1:
        return
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if zero_stage > 1:
        source = "--zero-stage" if args.zero_stage is not None else args.ds_config
        fail(f"--pp {args.pp}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, and "
             f"{source} sets stage {zero_stage}; use --zero-stage 1")
    if zero_stage == 0 and dtype == "fp32" and ds_config.get("gradient_clipping", 1.0) > 0:
        # DeepSpeed's default gradient_clipping is 1.0.
        fail(f"--pp {args.pp} with ZeRO stage 0 in fp32: DeepSpeed's fp32 gradient clipping "
             "leaves the later stages' replicated parameters out of the gradient norm; use "
             "--zero-stage 1 (or fp16/bf16, or gradient_clipping 0)")


def set_batch(args: argparse.Namespace, ds_config: dict, dp: int) -> BatchSplit:
    """Global batch, micro-batch and the gradient accumulation that joins them over dp ranks;
    a micro-batch `auto` is checked here and chosen at the start (train/micro_batch.py)."""
    if args.micro_batch is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.global_batch is not None:
        ds_config["train_batch_size"] = args.global_batch
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    batch = ds_config.get("train_batch_size")
    if micro is None or batch is None:
        fail(f"{args.ds_config}: set train_batch_size and train_micro_batch_size_per_gpu "
             "(or --global-batch and --micro-batch)")
    if type(batch) is not int or batch < 1:
        source = "--global-batch" if args.global_batch is not None else \
            f"{args.ds_config}'s train_batch_size"
        fail(f"{source} {json.dumps(batch)}: give a count of samples, at least 1")
    ramp = RampSettings(*args.rampup_batch_size) if args.rampup_batch_size else None
    unsplit = BatchSplit(batch, None, None, dp, ramp=ramp)
    if micro == MICRO_BATCH_AUTO:
        check_auto(args, unsplit)
        return unsplit
    if type(micro) is not int or micro < 1:
        fail(f"{args.ds_config}: train_micro_batch_size_per_gpu {json.dumps(micro)} is neither a "
             f"count of samples nor \"{MICRO_BATCH_AUTO}\"")
    note = ""
    if args.micro_batch is None and (lowered := lowered_micro_batch(batch, micro, dp)):
        note = (f"{args.ds_config}'s micro-batch {micro} lowered to {lowered}, each rank's "
                "share; --micro-batch sets it")
        micro = lowered
    if batch % (micro * dp):
        fail(f"global batch {batch} is not a multiple of micro-batch {micro} x {dp} data-parallel "
             "ranks; change --global-batch or --micro-batch")
    if ramp is not None:
        problem = batch_ramp.check(ramp, batch, micro, dp)
        if problem:
            fail(problem)
    return with_micro_batch(ds_config, unsplit, micro, note)


def lowered_micro_batch(batch: int, micro: int, dp: int) -> Optional[int]:
    """A config's micro-batch is the most one rank runs at once: with more data-parallel ranks
    than that many fill the global batch, each runs its share in one micro-batch (None: the
    config's stands)."""
    return batch // dp if batch % dp == 0 and batch // dp < micro else None


def check_auto(args: argparse.Namespace, split: BatchSplit) -> None:
    """What --micro-batch auto (given, or the config's) needs before any work: one data-parallel
    share per rank, a micro-batch the batch ramp allows, no pipeline, a loss the split leaves
    alone."""
    source = (f"--micro-batch {MICRO_BATCH_AUTO}" if args.micro_batch == MICRO_BATCH_AUTO
              else f"{args.ds_config}'s micro-batch \"{MICRO_BATCH_AUTO}\"")
    batch, dp = split.global_batch, split.dp
    if batch % dp:
        fail(f"global batch {batch} does not split into equal shares for {dp} data-parallel "
             "ranks; change --global-batch or the number of processes")
    if args.pp > 1:
        fail(f"--pp {args.pp}: {source} probes the whole model on one device, and a pipeline "
             "stage's memory depends on the micro-batches its schedule keeps in flight; give "
             f"--micro-batch N, a divisor of each data-parallel rank's {batch // dp} samples")
    if args.loss_normalization != normalization.PER_TOKEN:
        fail(f"--loss-normalization {args.loss_normalization} with {source}: the mean of each "
             "micro-batch's mean depends on the split, which auto chooses by memory (another "
             f"device, another split); give --micro-batch N, a divisor of {batch // dp}")
    if not micro_batch_candidates(batch, dp, split.ramp):
        fail(batch_ramp.check(split.ramp, batch, 1, dp))  # even micro-batch 1: the ramp's fault


def micro_batch_candidates(global_batch: int, dp: int, ramp: Optional[RampSettings]) -> list:
    """The micro-batches a rank may run, ascending: the divisors of its share of the global
    batch that a batch ramp allows."""
    share = global_batch // dp
    return [micro for micro in range(1, share + 1) if share % micro == 0
            and not (ramp and batch_ramp.check(ramp, global_batch, micro, dp))]


def with_micro_batch(ds_config: dict, split: BatchSplit, micro: int, note: str = "",
                     auto: Optional[dict] = None) -> BatchSplit:
    """`split` at micro-batch `micro`, written into `ds_config` with the gradient accumulation
    that joins it to the global batch over the data-parallel ranks."""
    accumulation = split.global_batch // (micro * split.dp)
    ds_config["train_micro_batch_size_per_gpu"] = micro
    ds_config["gradient_accumulation_steps"] = accumulation
    return dataclasses.replace(split, micro_batch=micro, accumulation=accumulation, note=note,
                               auto=auto)


def set_schedule(args: argparse.Namespace, ds_config: dict) -> dict:
    """Learning rate and warmup overrides, and --lr-schedule's shape (schedule.py); the decay
    ends at --steps. Returns the training settings as asked (identity.training_settings),
    before a warmup longer than --steps is shortened to it: a later, larger --steps is the same
    schedule."""
    if args.lr_schedule is not None:
        warmup = config_warmup(ds_config)
        ds_config["scheduler"] = scheduler_config(args, warmup)
        if args.lr_schedule == "cosine":  # WarmupCosineLR scales the optimizer's own rate
            ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = \
                warmup["peak_lr"]
    scheduler = ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in scheduler:
        scheduler["total_num_steps"] = args.steps
    if args.warmup_steps is not None:
        scheduler["warmup_num_steps"] = args.warmup_steps
    if args.lr is not None:
        ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if "warmup_max_lr" in scheduler:
            scheduler["warmup_max_lr"] = args.lr
    for key, flag in (("warmup_num_steps", "--warmup-steps"), ("decay_num_steps",
                                                               "--decay-steps")):
        if key in scheduler and type(scheduler[key]) is not int:  # "auto", 20.0, "20"
            fail(f"{args.ds_config}: the scheduler's {key} is {json.dumps(scheduler[key])}, not a "
                 f"whole number of steps; give one there, or {flag} N")
    asked = training_settings(ds_config)
    if args.lr_schedule is not None and scheduler.get("warmup_num_steps", 0) < 1:
        fail(f"--lr-schedule {args.lr_schedule}: {args.ds_config} gives no warmup "
             "(its scheduler's warmup_num_steps); add --warmup-steps N (at least 1)")
    warmup = scheduler.get("warmup_num_steps", 0)
    if warmup > args.steps:
        scheduler["warmup_num_steps"] = args.steps
    decay = scheduler.get("decay_num_steps")
    if decay is not None and decay > decay_room(args.steps, scheduler["warmup_num_steps"]):
        shortened = (f" (the warmup of {warmup} cut to --steps {args.steps})"
                     if warmup > args.steps else "")
        fail(f"--decay-steps {decay} leaves no step at the peak: a warmup of "
             f"{scheduler['warmup_num_steps']} steps{shortened} reaches it at step "
             f"{max(2, scheduler['warmup_num_steps']) + 2} (DeepSpeed's schedulers start 2 "
             f"steps late), so --steps {args.steps} allows at most --decay-steps "
             f"{max(0, decay_room(args.steps, scheduler['warmup_num_steps']))}; lower "
             "--decay-steps or --warmup-steps, or raise --steps")
    return asked
