"""The libraries' torch.compile decorations made as they import, compiled at the first call
instead: megatron-core's `jit_fuser` (megatron/core/jit.py; its fused bias + dropout + add,
tupe_ds's bias + GELU in attention.py) and DeepSpeed's Muon, which DeepSpeed's ZeRO imports to
check any run's optimizer. The first such decoration in a process imports inductor's compiler,
about a second of CPU (bench/startup.py), in every process, also in one that compiles nothing
(the CPU default); a decorated function compiles at its first call either way.

Any process that imports tupe_ds before those modules does this (`defer_library_compiles`, at
tupe_ds's import). TUPE_DS_COMPILE_AT_IMPORT=on (or 1, true, yes) leaves the decorations as the
libraries make them, the reference.
"""

import functools
import importlib
import importlib.machinery
import sys

from tupe_ds.tools import settings

COMPILE_SETTING = "TUPE_DS_COMPILE_AT_IMPORT"
MEGATRON_JIT = "megatron.core.jit"  # jit_fuser = torch.compile, which the fusions decorate with
DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.original_muon"  # @compiler.compile()
DEEPSPEED_COMPILER = "deepspeed.runtime.compiler"


def compiled_on_first_call(model=None, **options):
    """torch.compile's signature, the compiled function made at the first call outside a region
    being compiled; inside one (or an export), the function itself, which dynamo traces into the
    region, as it does a compiled function."""
    import torch

    if model is None:  # @torch.compile(dynamic=False)
        return functools.partial(compiled_on_first_call, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return model(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return call


class _CompileOnFirstCall:
    """A finder of sys.meta_path: finds MEGATRON_JIT and DEEPSPEED_MUON as Python would, and
    runs them so that they decorate with compiled_on_first_call where they would with
    torch.compile. No other module sees a difference (torch.compile itself is untouched)."""

    def find_spec(self, name, path, target=None):
        if name not in (MEGATRON_JIT, DEEPSPEED_MUON):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_megatron_jit(module):
            run_module(module)
            if module.jit_fuser is module.torch.compile:
                module.jit_fuser = compiled_on_first_call

        def run_deepspeed_muon(module):
            compiler = importlib.import_module(DEEPSPEED_COMPILER)
            compile_decorator = compiler.compile
            compiler.compile = lambda: compiled_on_first_call  # used as @compiler.compile()
            try:
                run_module(module)
            finally:
                compiler.compile = compile_decorator

        spec.loader.exec_module = run_megatron_jit if name == MEGATRON_JIT else run_deepspeed_muon
        return spec


def defer_library_compiles() -> None:
    """Has MEGATRON_JIT and DEEPSPEED_MUON, when they import, compile their functions at the
    first call (see above); not with TUPE_DS_COMPILE_AT_IMPORT=on."""
    if settings.switched_on(COMPILE_SETTING):
        return
    # by name: tupe_ds imported again (its modules dropped from sys.modules) makes another class
    if not any(type(finder).__name__ == _CompileOnFirstCall.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompileOnFirstCall())
