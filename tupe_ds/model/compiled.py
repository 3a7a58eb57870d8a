"""A torch.compile region as a run uses it: a planned number of graphs, each compile timed and
said, inductor's cache in the run folder, and eager where a compile fails.

- **Graphs.** Shapes are static (the fastest kernels; a run's shapes are fixed) and the callers
  keep the inputs' kinds fixed (the encoder passes a padding mask always), so a region compiles
  one graph for training (gradients, dropout) and one for evaluation: `PLANNED_GRAPHS`. A graph
  beyond that is one warning naming the guard that failed (dynamo's own `guard_failures`).
- **Compile once per run.** `keep_compiled_in(run_folder)` points inductor's cache (and Triton's,
  which lives inside it) at the run folder, unless TORCHINDUCTOR_CACHE_DIR names one: a requeue
  on any node, and every rank, finds the kernels compiled by the first start (inductor writes
  its entries atomically; any torch, graph or setting change is a new key, never a stale hit).
- **A compile that fails** (inductor, Triton, a kernel the device lacks) is one warning with the
  error's first line, and the region runs eager from then on. The backward is compiled with the
  forward (AOTAutograd waits for the first backward by default, where a failure could no longer
  fall back): either fails before a graph has run, so nothing of the step is lost.
"""

import logging
import os
import time
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters, guard_failures
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

logger = logging.getLogger(__name__)

PLANNED_GRAPHS = 2  # training and evaluation
CACHE_FOLDER = "compile-cache"
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def keep_compiled_in(run_folder: str) -> str:
    """Inductor's cache for this process: the one TORCHINDUCTOR_CACHE_DIR names, else
    RUN_FOLDER/compile-cache. Call before the first compile; returns the folder."""
    # torch writes its default into the variable once it has looked for it: that one is no
    # user's choice.
    if os.environ.get(CACHE_VARIABLE) in (None, "", default_cache_dir()):
        os.environ[CACHE_VARIABLE] = os.path.abspath(os.path.join(run_folder, CACHE_FOLDER))
    return os.environ[CACHE_VARIABLE]


def first_line(error: BaseException) -> str:
    """`error`'s type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def cache_hits() -> tuple[int, int]:
    """(graphs inductor found in its cache, graphs it compiled) in this process so far."""
    return (counters["inductor"]["fxgraph_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"])


class CompiledRegion:
    """`function` (a bound method or a module) compiled as one region; called as `function`.

    `graphs` counts the graphs it compiled, `compile_seconds` the time of the calls that
    compiled them, `failure` is the failed compile's first line (None while it compiles)."""

    def __init__(self, function: Callable, name: str):
        self.function, self.name = function, name
        self.compiled = torch.compile(function, dynamic=False, options={"size_asserts": False})
        code = getattr(function, "__code__", None) or type(function).forward.__code__
        self.guard_failures = guard_failures[code]
        self.graphs, self.compile_seconds = 0, 0.0
        self.failure: Optional[str] = None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            return self.function(*args, **kwargs)
        graphs, failures = counters["stats"]["unique_graphs"], len(self.guard_failures)
        hits, started = cache_hits(), time.perf_counter()
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                output = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.compiled = None
            self.failure = first_line(error.inner_exception)
            logger.warning("tupe_ds: torch.compile of %s failed (%s): it runs eager from here",
                           self.name, self.failure)
            return self.function(*args, **kwargs)
        if counters["stats"]["unique_graphs"] != graphs:
            self.compiled_a_graph(time.perf_counter() - started, self.guard_failures[failures:],
                                  [now - before for now, before in zip(cache_hits(), hits)])
        return output

    def compiled_a_graph(self, seconds: float, failed_guards: list, hits: list) -> None:
        self.graphs += 1
        self.compile_seconds += seconds
        kind = "training" if torch.is_grad_enabled() else "evaluation"
        logger.info("tupe_ds: compiled the %s graph of %s in %.1f s (inductor's cache %s held "
                    "%d of its %d forward and backward graphs)", kind, self.name, seconds,
                    os.environ.get(CACHE_VARIABLE), hits[0], sum(hits))
        if self.graphs > PLANNED_GRAPHS:
            guards = "; ".join(reason.splitlines()[0] for reason in failed_guards) or "unknown"
            logger.warning("tupe_ds: %s compiled graph %d, beyond the plan of %d (training, "
                           "evaluation): the guard that failed: %s", self.name, self.graphs,
                           PLANNED_GRAPHS, guards)


def regions(model: torch.nn.Module) -> list:
    """The CompiledRegions of `model`'s modules (attributes named `region`)."""
    return [module.region for module in model.modules()
            if isinstance(getattr(module, "region", None), CompiledRegion)]


def summary(model: torch.nn.Module) -> Optional[str]:
    """One line on what `model`'s regions compiled in this process (None where nothing is
    compiled): graphs, seconds, what inductor's cache held, or the failure."""
    found = regions(model)
    if not found:
        return None
    failed = sorted({region.failure for region in found if region.failure})
    if failed:
        return f"torch.compile failed, the model ran eager: {'; '.join(failed)}"
    graphs = sum(region.graphs for region in found)
    hits, misses = cache_hits()
    return (f"torch.compile: {graphs} graph{'s' * (graphs != 1)} in "
            f"{sum(region.compile_seconds for region in found):.1f} s; inductor's cache "
            f"{os.environ.get(CACHE_VARIABLE, '(of this node)')} held {hits} of the "
            f"{hits + misses} forward and backward graphs")
