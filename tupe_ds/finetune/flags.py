"""Flags that tupe-finetune and tupe-compare share: lists of values, and the batch size in
Megatron's spelling (global) or HF's (per device)."""

import argparse
from tupe_ds.tools import command_line
from tupe_ds.tools.errors import BatchSizeError

DEFAULT_GLOBAL_BATCH = 32  # the paper's (Table 2)


def list_of(kind, metavar: str) -> dict:
    """add_argument's keywords of a list flag: space-separated as argparse, HF and Megatron take
    them (`--seeds 1 2 3`), or comma-separated as tupe-compare took them before (`--seeds 1,2,3`);
    the flag's value is a tuple of every item, in order."""
    def items(text: str) -> tuple:
        try:
            return tuple(kind(item) for item in text.split(",") if item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not {kind.__name__} values") from None

    return {"nargs": "+", "type": items, "action": _Joined, "metavar": metavar}


class _Joined(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        joined = tuple(item for value in values for item in value)
        if not joined:
            raise argparse.ArgumentError(self, "give at least one value")
        setattr(namespace, self.dest, joined)


def add_batch_flags(p: argparse.ArgumentParser) -> None:
    """--global-batch-size (alias --batch-size) and --per-device-train-batch-size."""
    p.add_argument("--global-batch-size", "--batch-size", type=command_line.positive, metavar="N",
                   help="examples per optimizer step summed over all processes, as Megatron's "
                        f"--global-batch-size (--batch-size: its earlier name; default "
                        f"{DEFAULT_GLOBAL_BATCH}, the paper's)")
    p.add_argument("--per-device-train-batch-size", type=command_line.positive, metavar="N",
                   help="examples per optimizer step on each process, as the HF Trainer's: the "
                        "global batch is N times the processes (no gradient accumulation); given "
                        "with --global-batch-size, the two must agree")


def global_batch_size(args, processes: int) -> int:
    """The examples of one optimizer step over all `processes`, from add_batch_flags' flags."""
    per_device, given = args.per_device_train_batch_size, args.global_batch_size
    if per_device is None:
        batch = DEFAULT_GLOBAL_BATCH if given is None else given
        if batch < processes:
            raise BatchSizeError(f"--global-batch-size {batch} leaves some of the {processes} "
                                 f"processes without an example; give at least {processes}")
        return batch
    if given is not None and given != per_device * processes:
        fix = (f"--per-device-train-batch-size {given // processes} for a global batch of "
               f"{given}, or " if given % processes == 0 else "")
        on = f"{processes} process{'es' if processes > 1 else ''}"
        raise BatchSizeError(
            f"--per-device-train-batch-size {per_device} on {on} is a global batch of "
            f"{per_device * processes}, not --global-batch-size {given}; give {fix}only one of "
            "the two")
    return per_device * processes
