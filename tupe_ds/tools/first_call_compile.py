"""The libraries' torch.compile decorations made as they import, compiled at the first call
instead: megatron-core's fused elementwise functions (its `jit_fuser`: bias + dropout + add,
bias + GELU...) and DeepSpeed's Muon, which DeepSpeed's ZeRO imports to check any run's
optimizer. The first such decoration in a process imports inductor's compiler, about a second of
CPU (bench/startup.py), in every process, also in one that compiles nothing (the CPU default);
a decorated function compiles at its first call either way.

Any process that imports tupe_ds before those modules does this (`defer_library_compiles`, at
tupe_ds's import). TUPE_DS_COMPILE_AT_IMPORT=on (or 1, true, yes) leaves the decorations as the
libraries make them, the reference.
"""

import functools
import importlib.abc
import importlib.machinery
import sys

from tupe_ds.tools import settings

COMPILE_SETTING = "TUPE_DS_COMPILE_AT_IMPORT"
COMPILE_ON_FIRST_CALL = ("megatron.core.jit", "deepspeed.runtime.zero.muon.original_muon")


def compiled_on_first_call(model=None, **options):
    """torch.compile's signature, the compiled function made at its first call (first called
    inside a region being compiled, dynamo traces it into the region, as a compiled function)."""
    if model is None:  # @torch.compile(dynamic=False)
        return functools.partial(compiled_on_first_call, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = (_torch_compile or torch.compile)(model, **options)
        return compiled(*args, **kwargs)

    return call


_torch_compile = None  # torch.compile itself, while a module in COMPILE_ON_FIRST_CALL runs


class _CompileOnFirstCall(importlib.abc.MetaPathFinder):
    """Finds the modules of COMPILE_ON_FIRST_CALL as Python would, and runs each with
    torch.compile standing for compiled_on_first_call."""

    def find_spec(self, name, path, target=None):
        if name not in COMPILE_ON_FIRST_CALL:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_deferring_compile(module):
            global _torch_compile
            import torch

            _torch_compile = _torch_compile or torch.compile
            torch.compile = compiled_on_first_call
            try:
                run_module(module)
            finally:
                torch.compile = _torch_compile

        spec.loader.exec_module = run_deferring_compile
        return spec


def defer_library_compiles() -> None:
    """Has the modules of COMPILE_ON_FIRST_CALL, when they import, compile their functions at
    their first call (see above); not with TUPE_DS_COMPILE_AT_IMPORT=on."""
    if settings.switched_on(COMPILE_SETTING):
        return
    if not any(isinstance(finder, _CompileOnFirstCall) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompileOnFirstCall())
