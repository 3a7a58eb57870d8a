"""Third-party warnings that say nothing to a tupe_ds user, silenced at tupe_ds's entry points.

Every command (tupe-*, `python -m tupe_ds.X`, `python -m data_prep.cli`) imports this module
before any library (only tupe_ds/tools/startup.py comes earlier), so before megatron-core,
DeepSpeed or torch warn at their own import. Each filter names the message, where it comes from
and why a tupe_ds user can ignore it; anything else still shows.
`--verbose` on the command line, or TUPE_DS_VERBOSE=1, shows them all (and, exported, in every
process a launcher starts).
"""

import contextlib
import glob
import io
import logging
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from tupe_ds.tools import settings

VERBOSE = "TUPE_DS_VERBOSE"


@dataclass(frozen=True)
class Quieted:
    message: str  # a regular expression matched at the start of the message
    origin: str  # the module that warns: a warnings module regex, or a logger's name
    why: str
    logger: bool = False  # a logging record (else a warnings.warn)
    applies: Callable[[], bool] = lambda: True  # where it says nothing; elsewhere it shows

    def filter(self, record: logging.LogRecord) -> bool:  # as a logger's filter
        return re.match(self.message, record.getMessage()) is None


CPU_FALLBACK = Quieted(
    r"Setting accelerator to CPU", "DeepSpeed",
    "said on a machine without NVIDIA GPUs (no nvidia-smi, no /dev/nvidia*), where the CPU is the "
    "only choice; where GPUs exist but CUDA was not found it still shows",
    logger=True, applies=lambda: not nvidia_gpus_present())
QUIETED = (
    Quieted(r"(Transformer Engine and )?Apex (is|are) not installed", r"megatron\.core",
            "megatron-core falls back to torch's kernels, the ones tupe_ds builds its layers on "
            "(its norms, optimizers and fused kernels come from torch and DeepSpeed)"),
    Quieted(r"full scope is deprecated", r"megatron\.core",
            "megatron-core's TransformerConfig warns about its own CUDA-graph default; tupe_ds "
            "captures no CUDA graphs"),
    Quieted(r"is_fx_tracing will return true", "torch.fx._symbolic_trace",
            "megatron-core asks torch whether it is being traced; tupe_ds never traces it",
            logger=True),
    Quieted(r"Attempting to get learning rate from scheduler before it has started", "DeepSpeed",
            "DeepSpeed's WarmupLR and WarmupDecayLR ask themselves for their rate in their own "
            "constructor, before step 0, and start at warmup_min_lr as they should",
            logger=True),
    Quieted(r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
            r"deprecated", r"torch\.distributed",
            "DeepSpeed's ZeRO calls all_gather_single and reduce_scatter_single by the names they "
            "had before torch 2.13: the same collectives"),
    CPU_FALLBACK,
    Quieted(r"The PyTorch API of nested tensors is in prototype stage", r"torch\.",
            "tupe_ds's unpadded attention layout uses nested tensors on purpose and tests them "
            "against the dense layout (tests/test_attention.py)"),
)


def nvidia_gpus_present() -> bool:
    return shutil.which("nvidia-smi") is not None or bool(glob.glob("/dev/nvidia[0-9]*"))


def launcher_accelerator() -> Optional[str]:
    """DS_ACCELERATOR for the deepspeed launcher's own processes (its runner and launch.py), which
    are DeepSpeed's and import none of these filters: "cpu" where DeepSpeed, left to choose, falls
    back to the CPU and tupe_ds filters what it says then (CPU_FALLBACK), so that they make the
    same choice without saying it. None where the user set DS_ACCELERATOR, asked for --verbose,
    where DeepSpeed finds an accelerator (CUDA, XPU, NPU...), or where NVIDIA GPUs are there
    but CUDA is not: that warning is for the user."""
    if "DS_ACCELERATOR" in os.environ or verbose() or not CPU_FALLBACK.applies():
        return None
    from deepspeed.accelerator import get_accelerator  # its fallback warning filtered: quiet()

    return "cpu" if get_accelerator().device_name() == "cpu" else None


def verbose() -> bool:
    """--verbose in this process's arguments (then exported to its children) or TUPE_DS_VERBOSE."""
    if "--verbose" in sys.argv[1:]:
        os.environ[VERBOSE] = "1"
    return settings.switched_on(VERBOSE)


def quiet() -> None:
    """Installs the filters of QUIETED, unless verbose."""
    if verbose():
        return
    for quieted in QUIETED:
        if not quieted.applies():
            continue
        if quieted.logger:
            logging.getLogger(quieted.origin).addFilter(quieted)
        else:
            warnings.filterwarnings("ignore", message=quieted.message, module=quieted.origin)


def add_verbose_flag(parser) -> None:
    """--verbose, read by quiet() at import, listed in the command's help."""
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party warnings too (the ones tupe_ds filters say "
                             "nothing to a user: tupe_ds/tools/third_party_warnings.py); "
                             f"{VERBOSE}=1 likewise")


quiet()


def quietly(work: Callable):
    """work(), a library's prints and progress bars kept off the terminal (zero_to_fp32's
    "Processing zero checkpoint", ds_to_universal's lines, a bar per file), and logged as an
    error where it fails."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            return work()
    except BaseException:
        if said.getvalue().strip():
            logging.getLogger(__name__).error(said.getvalue()[-4000:])
        raise
