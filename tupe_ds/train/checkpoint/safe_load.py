"""Reading checkpoint files without running code: tupe_ds's loads and DeepSpeed's read only tensors
and the DeepSpeed types its checkpoints hold; a file naming another type is damage, unless other
versions wrote it (OtherSoftware). See docs/reliability.md."""

import contextlib
import importlib.metadata
import os
import pickle
import re
import warnings
import zipfile
from typing import Dict, Optional

import torch

from tupe_ds.tools.errors import OtherSoftware
from tupe_ds.tools.files import regular_file
from tupe_ds.train.checkpoint import reads

FORCE = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
SOFTWARE = ("torch", "deepspeed", "megatron-core", "tupe_ds")  # what decides what loads


def allow_deepspeed_types() -> None:
    """Weights-only loads read what DeepSpeed 0.19 pickles beside tensors (loss scalers, ZeRO stage,
    fragment addresses), for the process: torch's safe_globals() context would take them away."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    torch.serialization.add_safe_globals(
        [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])


def weights_only_everywhere() -> None:
    """Every torch.load of this process reads weights-only, even DeepSpeed's weights_only=False."""
    os.environ.pop(FORCE[1], None)
    os.environ[FORCE[0]] = "1"
    allow_deepspeed_types()


@contextlib.contextmanager
def weights_only_loads():
    """weights_only_everywhere while the block runs; the environment as it was afterwards."""
    saved = {name: os.environ.get(name) for name in FORCE}
    weights_only_everywhere()
    try:
        yield
    finally:
        for name in FORCE:
            os.environ.pop(name, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def load(path: str, mmap: bool = False, root: Optional[str] = None):
    """torch.load(path) weights-only on the CPU (mmap: memory-mapped, if in torch's zip format);
    NotRegularFile (not a regular file inside `root`), reads.Unreadable."""
    allow_deepspeed_types()
    return reads.retried(path, lambda: torch.load(
        regular_file(path, root), map_location="cpu", weights_only=True,
        mmap=mmap and zipfile.is_zipfile(path)))


def scan(path: str, written_by: Optional[Dict[str, str]] = None) -> Optional[str]:
    """None when `path` loads weights-only; else the line that says why not. OtherSoftware when
    the type it names is one the installed software does not load and other versions than it
    wrote the file (`written_by`: its manifest's); FileNotFoundError, reads.Unreadable."""
    try:
        with warnings.catch_warnings():  # damaged bytes read as a pickle protocol: the line says
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning, "torch")
            load(path, mmap=True)
    except (FileNotFoundError, reads.Unreadable):
        raise
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", str(error))
        if named:
            refuse_if_written_by_others(path, named.group(1), written_by or {})
        reason = (f"it names {named.group(1)}" if named else
                  (str(error).split("WeightsUnpickler error:")[-1].strip().splitlines() or [""])[0])
        return (f"{path}: holds more than tensors and the types tupe_ds's checkpoints hold "
                f"({reason}); it is not loaded, since unpickling it could run code. If you "
                "trust its source, load it with torch.load(weights_only=False) yourself")
    except Exception as error:  # torch's unpickler meets a damaged file with any exception
        first_line = (str(error).splitlines() or [""])[0]
        return f"{path}: unreadable ({type(error).__name__}: {first_line})"
    return None


def software_versions() -> Dict[str, str]:
    return {name: importlib.metadata.version(name) for name in SOFTWARE}


def refuse_if_written_by_others(path: str, named: str, written_by: Dict[str, str]) -> None:
    """OtherSoftware when other versions (`written_by`) wrote the intact file `path`, which names
    a type the installed software does not load (`named`)."""
    installed = software_versions()
    differing = [n for n in SOFTWARE if n in written_by and written_by[n] != installed[n]]
    if differing:
        raise OtherSoftware(
            f"{path} names {named}, which the installed software does not load; the checkpoint "
            f"was written by " + ", ".join(f"{n} {written_by[n]}" for n in differing)
            + " and this is " + ", ".join(f"{n} {installed[n]}" for n in differing)
            + ". Resume it with the versions that wrote it; or, to resume an earlier checkpoint, "
            f"move {os.path.dirname(path)} out of its folder. Nothing was moved or deleted")
