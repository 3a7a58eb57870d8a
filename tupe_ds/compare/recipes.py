"""A comparison's recipe (`tupe-compare run --recipe`): the tupe-pretrain flags it adds to every
run, so that the paper's Table 1 and Figure 5 can be made under today's training practice too.

- paper (the default): nothing is added; the runs train as --ds-config and the flags say (with
  the shipped configs: 15% masking, a linear decay, one batch size all along).
- modern: what ModernBERT, MosaicBERT and Cramming train with, where tupe-pretrain has it:
  30% masking (Wettig et al. 2023: more than 15% pays for BERT-Large); warmup, a stable rate,
  then a 1-sqrt decay over the last DECAY_SHARE of the steps (Hägele et al. 2024); the global
  batch ramped up from about RAMP_START_SHARE of it over the first RAMP_SHARE of the steps;
  bf16 where every GPU has it (doctor.Machine.half_precision, as `make demo` chooses).

A flag given on the command line that the recipe would add wins: the recipe leaves it out and
its notes say so. Its precision is not a flag: on GPUs with bf16 it writes OUT/DS_CONFIG_FILE,
the --ds-config with bf16 in place of its precision, and the runs take that one. What modern
recipes have that tupe_ds does not: docs/pretraining.md, "Modern recipes".
"""

import functools
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

from tupe_ds.machine import doctor
from tupe_ds.train.batch_ramp import BatchRamp, RampSettings
from tupe_ds.train.ds_config import BatchSplit
from tupe_ds.train.precision import with_bf16
from tupe_ds.train.schedule import decay_room

RECIPES = ("paper", "modern")
MODERN_MASK_RATE = 0.3
DECAY_SHARE = 0.2  # the decay phase: the last fifth of the steps
DECAY_SHAPE = "1-sqrt"
RAMP_SHARE = 0.25  # the batch is full after about a quarter of the steps
RAMP_START_SHARE = 1 / 8  # the ramp starts at the first batch it allows from an eighth up
DS_CONFIG_FILE = "ds_config.modern.json"
SCHEDULE_FLAGS = ("--lr-schedule", "--decay-steps", "--decay-shape")


@dataclass(frozen=True)
class Recipe:
    name: str = "paper"
    flags: tuple = ()  # added to every run's flags; a --ds-config among them replaces the user's
    notes: tuple = ()  # what it set and what it left, one sentence each (the report's)
    ds_config: Optional[dict] = None  # the DeepSpeed config its --ds-config names (OUT/...)

    @property
    def ds_config_file(self) -> Optional[str]:
        """The DeepSpeed config file it makes the runs take; None: the user's --ds-config."""
        return given(self.flags, "--ds-config")

    def applied_to(self, flags: tuple) -> tuple:
        """A run's shared flags with the recipe's: its --ds-config in place of theirs."""
        if self.ds_config_file is not None:
            flags = without(flags, "--ds-config")
        return (*flags, *self.flags)


@functools.lru_cache(maxsize=None)
def spellings(name: str) -> tuple:
    """Every name of tupe-pretrain's flag `name` (--lr-schedule: --lr-decay-style too)."""
    from tupe_ds.train.flags import parser  # tupe-pretrain's own parser, read once

    return next((tuple(action.option_strings) for action in parser()._actions
                 if name in action.option_strings), (name,))


def given(flags, name: str) -> Optional[str]:
    """The value of tupe-pretrain's flag `name` in `flags`, under any of its names (`NAME VALUE`
    or `NAME=VALUE`; the last one, as argparse takes it); None when absent."""
    value, names = None, spellings(name)
    for i, flag in enumerate(flags):
        if flag in names:
            value = flags[i + 1] if i + 1 < len(flags) else ""
        elif flag.split("=", 1)[0] in names and "=" in flag:
            value = flag.split("=", 1)[1]
    return value


def without(flags, *names: str) -> tuple:
    """`flags` less every `NAME VALUE` and `NAME=VALUE` of `names`, under any of their names
    (flags of one value)."""
    every = {spelling for name in names for spelling in spellings(name)}
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in every:
            skip = True
        elif not ("=" in flag and flag.split("=", 1)[0] in every):
            kept.append(flag)
    return tuple(kept)


@dataclass(frozen=True)
class Ramp:
    """Megatron's --rampup-batch-size START INCREMENT SAMPLES up to `global_batch`: the batch is
    START + INCREMENT x floor(consumed / per_increment) while at most SAMPLES samples are
    consumed, SAMPLES spread evenly over the (global_batch - START) / INCREMENT increments."""
    start: int
    increment: int
    samples: int
    global_batch: int

    @property
    def flags(self) -> tuple:
        return ("--rampup-batch-size", str(self.start), str(self.increment), str(self.samples))

    def batches(self) -> Iterator[int]:
        """Each step's global batch until the first full one (excluded), as tupe-pretrain's ramp
        (megatron-core's calculator) gives them."""
        ramp = BatchRamp(RampSettings(self.start, self.increment, self.samples),
                         self.global_batch, 1, 1)
        consumed = 0
        while (batch := ramp(consumed)) < self.global_batch:
            yield batch
            consumed += batch

    @property
    def full_from(self) -> int:
        """The first step at the full global batch."""
        return sum(1 for _ in self.batches()) + 1


def decay_steps(steps: int) -> int:
    """The decay phase of a warmup-stable-decay schedule of `steps`: the last fifth, at least 1
    (schedule() cuts it to what the warmup leaves)."""
    return max(1, round(steps * DECAY_SHARE))


def batch_ramp(split: BatchSplit, steps: int) -> Optional[Ramp]:
    """The ramp for a run of `steps` at `split`'s batch; None where the global batch is one
    micro-batch per data-parallel rank (nothing smaller is allowed).

    Every batch of it is a multiple of micro-batch x dp (what tupe-pretrain and Megatron ask):
    START the first such multiple from global / 8 up, INCREMENT one micro-batch per rank.
    SAMPLES is chosen for the full batch to come after about a quarter of the steps: each
    increment gets SAMPLES / increments samples, which a batch b takes that many / b steps to
    go through, so steps = SAMPLES / increments x the sum of 1 / b over the ramp's batches."""
    unit = split.micro_batch * split.dp
    global_batch = split.global_batch
    if global_batch <= unit:
        return None
    start = unit * math.ceil(global_batch * RAMP_START_SHARE / unit)
    increments = (global_batch - start) // unit
    target = max(1, round(steps * RAMP_SHARE))
    per_increment = target / sum(1 / (start + i * unit) for i in range(increments))
    return Ramp(start, unit, max(1, round(per_increment * increments)), global_batch)


def flags_note(flags) -> str:
    return f"`{' '.join(flags)}`"


def masking(user_flags) -> tuple:
    """(flags, note) of the mask rate."""
    rate = given(user_flags, "--mask-rate")
    if rate is not None:
        return (), (f"mask rate {rate}: --mask-rate given, kept (the recipe's is "
                     f"{MODERN_MASK_RATE:g})")
    flags = ("--mask-rate", f"{MODERN_MASK_RATE:g}")
    return flags, f"mask rate {MODERN_MASK_RATE:g} ({flags_note(flags)})"


def schedule(user_flags, steps: int, warmup: int) -> tuple:
    """(flags, note) of the learning-rate schedule: warmup-stable-decay unless another is given,
    its decay the last DECAY_SHARE of the steps that the `warmup` steps leave room for; the
    flags of it the user gave are theirs."""
    chosen = given(user_flags, "--lr-schedule")
    if chosen is not None and chosen.lower() != "wsd":
        return (), (f"learning-rate schedule {chosen}: --lr-schedule given, kept (the recipe's "
                    f"is wsd, {DECAY_SHAPE} decay over the last {DECAY_SHARE:.0%} of the steps)")
    if warmup < 1:
        return (), ("no warmup-stable-decay: the --ds-config gives no warmup, which "
                    "tupe-pretrain's schedules need; --warmup-steps N lets the recipe add one")
    room = decay_room(steps, warmup)
    if room < 1 and given(user_flags, "--decay-steps") is None:
        return (), (f"no warmup-stable-decay: a warmup of {warmup} steps leaves no step at the "
                    f"peak before a decay in {steps}; the --ds-config's schedule kept (more "
                    "--steps or fewer --warmup-steps make room)")
    wanted = {"--lr-schedule": "wsd", "--decay-steps": str(min(decay_steps(steps), room)),
              "--decay-shape": DECAY_SHAPE}
    flags = tuple(part for flag, value in wanted.items() if given(user_flags, flag) is None
                  for part in (flag, value))
    decay = given(user_flags, "--decay-steps") or wanted["--decay-steps"]
    shape = given(user_flags, "--decay-shape") or DECAY_SHAPE
    kept = [flag for flag in SCHEDULE_FLAGS if given(user_flags, flag) is not None]
    return flags, (f"learning-rate schedule: the warmup as configured, a stable rate, then a "
                   f"{shape} decay to the minimum over the last {decay} of the {steps} steps"
                   + (f" ({flags_note(flags)})" if flags else "")
                   + (f"; {', '.join(kept)} given, kept" if kept else ""))


def ramping(user_flags, split: BatchSplit, steps: int) -> tuple:
    """(flags, note) of the batch ramp."""
    if given(user_flags, "--rampup-batch-size") is not None:
        return (), "batch ramp: --rampup-batch-size given, kept"
    if split.micro_batch is None:
        return (), ("no batch ramp: the micro-batch is auto, chosen at each run's start, and every "
                    "batch of a ramp is a multiple of micro-batch x data-parallel ranks; "
                    "--micro-batch N allows one")
    ramp = batch_ramp(split, steps)
    if ramp is None:
        return (), (f"no batch ramp: the global batch {split.global_batch} is one micro-batch "
                    f"({split.micro_batch}) per data-parallel rank ({split.dp}), and every batch "
                    "of a ramp is a multiple of that; a larger --global-batch or a smaller "
                    "--micro-batch allows one")
    full = ramp.full_from
    return ramp.flags, (f"batch ramp: {ramp.start} to {ramp.global_batch} samples a step by "
                        f"{ramp.increment} over the first {ramp.samples} samples, the full batch "
                        + (f"from step {full} of {steps}" if full <= steps
                           else f"not within the {steps} steps")
                        + f" ({flags_note(ramp.flags)})")


def precision(ds_config: dict, path: str, machine: doctor.Machine, out: str) -> tuple:
    """(flags, note, DeepSpeed config or None) of the precision: bf16 where every GPU has it,
    written to OUT/DS_CONFIG_FILE when --ds-config asks for another; else the config's."""
    dtype = doctor.precision(ds_config)
    half = machine.half_precision
    if half != "bf16":
        why = ("no GPU: bf16 is for GPUs that all have it, as make demo chooses"
               if machine.accelerator != "cuda" or not machine.gpus
               else "these GPUs lack bf16, which needs compute capability "
                    f"{doctor.BF16_CAPABILITY[0]}.{doctor.BF16_CAPABILITY[1]} or newer")
        return (), f"precision {dtype}, the --ds-config's ({why})", None
    if dtype == "bf16":
        return (), "precision bf16, the --ds-config's", None
    flags = ("--ds-config", os.path.join(out, DS_CONFIG_FILE))
    return flags, (f"precision bf16 (these GPUs have it): {flags[1]}, {path} with bf16 in "
                   f"place of its {dtype} ({flags_note(flags)})"), with_bf16(ds_config)


def modern(steps: int, split: BatchSplit, warmup: int, machine: doctor.Machine,
           user_flags: tuple, ds_config: dict, ds_config_path: str, out: str) -> Recipe:
    """The modern recipe for runs of `steps` at `split`'s batch after `warmup` steps of warmup
    on `machine`, whose shared flags are `user_flags` with `ds_config` read from
    `ds_config_path`."""
    flags, notes, config = [], [], None
    for part_flags, note in (masking(user_flags), schedule(user_flags, steps, warmup),
                             ramping(user_flags, split, steps)):
        flags += part_flags
        notes.append(note)
    part_flags, note, config = precision(ds_config, ds_config_path, machine, out)
    return Recipe("modern", (*flags, *part_flags), (*notes, note), config)
