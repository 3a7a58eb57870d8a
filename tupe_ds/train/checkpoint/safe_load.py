"""Reading checkpoint files without running code from them.

A .pt file is a pickle, and unpickling can run any code the file names. tupe_ds reads every
checkpoint file with `torch.load(weights_only=True)`: only tensors, containers, and the few
DeepSpeed types its checkpoints hold (ALLOWED). DeepSpeed's own loads (the engine's, zero_to_fp32,
ds_to_universal) ask for weights_only=False; tupe-pretrain and tupe-export make every load of
their process weights-only all the same (`weights_only_everywhere`), so that the very file
DeepSpeed unpickles is read safely. Before that, verification reads each file of a checkpoint
this way (`scan`: memory-mapped, so the tensors' bytes are not read), so that a file naming
anything else fails the checkpoint, named, and the run falls back to an earlier one; unless the
manifest says other versions of the software wrote it (an upgrade may have renamed a class it
holds): then the run is refused, naming both versions (`OtherSoftware`), since every checkpoint
of the run would fail alike.
"""

import contextlib
import importlib.metadata
import os
import pickle
import re
import zipfile
from typing import Dict, List, Optional, Tuple

import torch

from tupe_ds.tools.files import regular_file
from tupe_ds.train.checkpoint import reads


def allowed_globals() -> list:
    """What DeepSpeed 0.19 pickles beside tensors: the loss scaler (fp16 and fp32), the ZeRO
    stage, the fragment addresses of ZeRO's flat partitions."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_everywhere() -> None:
    """Every torch.load of this process reads with weights_only and ALLOWED types, whatever its
    caller asks (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD): DeepSpeed's engine, ds_to_universal and
    zero_to_fp32 pass weights_only=False, so the very file DeepSpeed unpickles is read safely,
    whether or not it was verified before (a file swapped after verification, or one of a
    conversion's)."""
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    torch.serialization.add_safe_globals(allowed_globals())


@contextlib.contextmanager
def weights_only_loads():
    """weights_only_everywhere while the block runs (tupe-export's reading, wherever it is
    called from: tupe-compare, make demo); the environment as it was afterwards."""
    saved = {name: os.environ.get(name) for name in
             ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    weights_only_everywhere()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load(path: str, mmap: bool = False):
    """torch.load(path) on the CPU, with only tensors and ALLOWED types; memory-mapped when
    `mmap` and the file is in torch's zip format (files of torch's older format are read).
    `path` must be a regular file (NotRegularFile: a FIFO would hang the load); a read that
    fails is retried (reads.retried), then reads.Unreadable: the filesystem's error is not the
    file's damage."""
    # added for the process, not for this call: torch's safe_globals() context would take them
    # away again from the loads weights_only_everywhere makes safe
    torch.serialization.add_safe_globals(allowed_globals())
    return reads.retried(path, lambda: torch.load(
        regular_file(path), map_location="cpu", weights_only=True,
        mmap=mmap and zipfile.is_zipfile(path)))


def scan(path: str) -> Optional[str]:
    """None when `path` reads with only allowed types; else the line that says why not. A read
    the filesystem does not give is not the file's damage: reads.Unreadable (FileNotFoundError
    at once)."""
    return inspect(path)[0]


def inspect(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(scan's line, the global the file names that is not allowed, when that is why)."""
    try:
        load(path, mmap=True)
    except (FileNotFoundError, reads.Unreadable):
        raise
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", str(error))
        reason = (f"it names {named.group(1)}" if named else
                  (str(error).split("WeightsUnpickler error:")[-1].strip().splitlines() or [""])[0])
        return (f"{path}: holds more than tensors and the types tupe_ds's checkpoints hold "
                f"({reason}); it is not loaded, since unpickling it could run code. If you "
                "trust its source, load it with torch.load(weights_only=False) yourself",
                named.group(1) if named else None)
    except Exception as error:  # torch's unpickler meets a damaged file with any exception
        first_line = (str(error).splitlines() or [""])[0]
        return f"{path}: unreadable ({type(error).__name__}: {first_line})", None
    return None, None


SOFTWARE = ("torch", "deepspeed", "megatron-core", "tupe_ds")  # what decides what loads


def software_versions() -> Dict[str, str]:
    """The installed versions of SOFTWARE (a checkpoint's manifest records its writer's)."""
    return {name: importlib.metadata.version(name) for name in SOFTWARE}


def other_versions(written_by: Dict[str, str]) -> List[str]:
    """`written_by`'s packages whose version differs from the installed one."""
    installed = software_versions()
    return [name for name in SOFTWARE if name in written_by and written_by[name] != installed[name]]


class OtherSoftware(Exception):
    """A checkpoint file that reads whole (its checksum the manifest's) names a type the
    installed software does not load, and other versions wrote it: not damage (a fallback would
    find every checkpoint so), but a refusal naming both versions."""

    def __init__(self, path: str, named: str, written_by: Dict[str, str]):
        installed = software_versions()
        differing = other_versions(written_by)
        super().__init__(
            f"{path} names {named}, which the installed software does not load; the checkpoint "
            f"was written by " + ", ".join(f"{n} {written_by[n]}" for n in differing)
            + " and this is " + ", ".join(f"{n} {installed[n]}" for n in differing)
            + ". Resume it with the versions that wrote it; or, to resume an earlier checkpoint, "
            f"move {os.path.dirname(path)} out of its folder. Nothing was moved or deleted")
