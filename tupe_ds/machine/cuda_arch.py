"""TORCH_CUDA_ARCH_LIST in the form DeepSpeed's extension builder can parse.

torch takes arch-specific and family targets such as `9.0a` and `10.0f` (Hopper and Blackwell
images often set them), but DeepSpeed 0.19's CUDAOpBuilder.compute_capability_args reads every
entry as MAJOR.MINOR[+PTX] with int(), so building one of its extensions (FusedAdam, for a config
that asks for it) dies with "invalid literal for int() with base 10: '0a'". DeepSpeed's kernels
use no arch-specific instructions, so the plain MAJOR.MINOR target loses nothing.
"""

import os
import re

VARIABLE = "TORCH_CUDA_ARCH_LIST"
_SUFFIXED = re.compile(r"(\d+\.\d+)[a-z]+")  # 9.0a, 10.0f; the "+PTX" after it is kept


def deepspeed_arch_list(value: str) -> str:
    """`value` without the entries' letter suffixes: 9.0a -> 9.0, 8.0;9.0a -> 8.0;9.0,
    9.0a+PTX -> 9.0+PTX, 10.0f -> 10.0; what DeepSpeed already parses is returned unchanged."""
    return _SUFFIXED.sub(r"\1", value)


def fit_cuda_arch_list(environ=os.environ):
    """Rewrite TORCH_CUDA_ARCH_LIST in `environ` for DeepSpeed; call it before the engine is
    built. Returns a line saying what changed, or None when nothing had to."""
    value = environ.get(VARIABLE)
    if value is None or deepspeed_arch_list(value) == value:
        return None
    environ[VARIABLE] = deepspeed_arch_list(value)
    return (f"{VARIABLE}={value!r} set to {environ[VARIABLE]!r}: DeepSpeed's extension builder "
            "cannot parse arch suffixes such as 'a' or 'f', and its kernels do not need them")
