"""Reading checkpoint files without running code from them.

A .pt file is a pickle, and unpickling can run any code the file names. tupe_ds reads every
checkpoint file with `torch.load(weights_only=True)`: only tensors, containers, and the few
DeepSpeed types its checkpoints hold (ALLOWED). DeepSpeed's own loads (the engine's, zero_to_fp32,
ds_to_universal) read with weights_only=False; before any of them runs on a checkpoint, tupe_ds
reads each of its files this way (`scan`: memory-mapped, so the tensors' bytes are not read), so
that a file naming anything else is refused before DeepSpeed unpickles it.
"""

import pickle
import zipfile
from typing import Optional

import torch


def allowed_globals() -> list:
    """What DeepSpeed 0.19 pickles beside tensors: the loss scaler (fp16 and fp32), the ZeRO
    stage, the fragment addresses of ZeRO's flat partitions."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load(path: str, mmap: bool = False):
    """torch.load(path) on the CPU, with only tensors and ALLOWED types; memory-mapped when
    `mmap` and the file is in torch's zip format (files of torch's older format are read)."""
    with torch.serialization.safe_globals(allowed_globals()):
        return torch.load(path, map_location="cpu", weights_only=True,
                          mmap=mmap and zipfile.is_zipfile(path))


def scan(path: str) -> Optional[str]:
    """None when `path` reads with only allowed types; else the line that says why not."""
    try:
        load(path, mmap=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        return (f"{path}: holds more than tensors and the types tupe_ds's checkpoints hold "
                f"({reason}); it is not loaded, since unpickling it could run code. If you "
                "trust its source, load it with torch.load(weights_only=False) yourself")
    except (RuntimeError, EOFError, OSError) as error:
        return f"{path}: unreadable ({str(error).splitlines()[0]})"
    return None
