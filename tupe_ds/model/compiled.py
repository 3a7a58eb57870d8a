"""A torch.compile region as a run uses it: a planned number of graphs, each compile timed and
said, inductor's cache in the run folder, and eager where a compile fails.

- **Graphs.** Shapes are static (the fastest kernels; a run's shapes are fixed) and the callers
  keep the inputs' kinds fixed (the encoder passes a padding mask always), so a region compiles
  one graph for training (gradients, dropout) and one for evaluation: `PLANNED_GRAPHS`, counted
  for the part of the model the region is (`Graphs`: the encoder, or a pipeline stage's layers,
  which share their graphs). A graph beyond that is one warning naming the guard that failed
  (dynamo's own `guard_failures`).
- **Compile once per run.** `keep_compiled_in(run_folder)` points inductor's cache (and Triton's,
  which lives inside it) at the run folder, unless TORCHINDUCTOR_CACHE_DIR names one: a requeue
  on any node, and every rank, finds the kernels compiled by the first start (inductor writes
  its entries atomically; any torch, graph or setting change is a new key, never a stale hit).
- **A compile that fails** (inductor, Triton, a kernel the device lacks) is one warning with the
  error's first line on each rank where it fails, and the region runs eager from then on; the
  run's summary names the ranks. The backward is compiled with the
  forward (AOTAutograd waits for the first backward by default, where a failure could no longer
  fall back): either fails before a graph has run, so nothing of the step is lost.
"""

import dataclasses
import logging
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tupe_ds.tools.log_lines import EVERY_RANK

logger = logging.getLogger(__name__)

PLANNED_GRAPHS = 2  # training and evaluation
CACHE_FOLDER = "compile-cache"
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def keep_compiled_in(run_folder: str) -> str:
    """Inductor's cache for this process: the one TORCHINDUCTOR_CACHE_DIR names, else
    RUN_FOLDER/compile-cache, else (that folder unusable: a file, no permission, a dangling
    link) the node's, with a warning. Call before the first compile; returns the folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # torch writes its default into the variable once it has looked for it: that one is no
    # user's choice.
    if os.environ.get(CACHE_VARIABLE) not in (None, "", default_cache_dir()):
        return os.environ[CACHE_VARIABLE]
    folder = os.path.abspath(os.path.join(run_folder, CACHE_FOLDER))
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"no permission to write in {folder}")
    except OSError as error:
        logger.warning("tupe_ds: inductor's cache cannot be %s (%s): this node's %s is used, "
                       "and a start on another node compiles again", folder, error,
                       default_cache_dir())
        os.environ[CACHE_VARIABLE] = default_cache_dir()
        return os.environ[CACHE_VARIABLE]
    os.environ[CACHE_VARIABLE] = folder
    return folder


def first_line(error: BaseException) -> str:
    """`error`'s type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def cache_hits() -> tuple[int, int]:
    """(graphs inductor found in its cache, graphs it compiled) in this process so far."""
    counters = torch._dynamo.utils.counters
    return (counters["inductor"]["fxgraph_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"])


@dataclasses.dataclass
class Graphs:
    """What the regions of one part of the model compiled (the layers of a pipeline stage share
    one: one compiled graph serves them all): graphs, the seconds of the calls that compiled
    them, and the failed compile's first line (None while it compiles)."""
    name: str
    count: int = 0
    seconds: float = 0.0
    failure: Optional[str] = None


class CompiledRegion:
    """`function` (a bound method or a module) compiled as one region; called as `function`.
    Its graphs, and a failure, are counted in `graphs`."""

    def __init__(self, function: Callable, graphs: Graphs):
        # imported by the first region, not with this module: `tupe-pretrain --help` imports no
        # dynamo (a run does, with torch's optimizer), and a run that compiles nothing imports
        # no inductor compiler (bench/startup.py)
        import torch._dynamo  # noqa: F401
        import torch._functorch.config  # noqa: F401

        self.function, self.graphs = function, graphs
        self.compiled = torch.compile(function, dynamic=False, options={"size_asserts": False})
        # the frame dynamo compiles: the method, or the module's __call__
        self.code = getattr(function, "__code__", None) or type(function).__call__.__code__

    def __call__(self, *args, **kwargs):
        if self.compiled is None or self.graphs.failure:
            return self.function(*args, **kwargs)
        # dynamo's reset() empties its table of failed guards: looked up at each call
        failed_guards = torch._dynamo.utils.guard_failures[self.code]
        counters = torch._dynamo.utils.counters
        graphs, failures = counters["stats"]["unique_graphs"], len(failed_guards)
        hits, started = cache_hits(), time.perf_counter()
        try:
            # 15 us a micro-batch (this CPU, 2026-12-02), where a global setting would change
            # every other compile of the process
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                output = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.compiled = None
            self.graphs.failure = first_line(error.inner_exception)
            logger.warning("tupe_ds: torch.compile of %s failed (%s): it runs eager from here",
                           self.graphs.name, self.graphs.failure, extra=EVERY_RANK)
            return self.function(*args, **kwargs)
        if counters["stats"]["unique_graphs"] != graphs:
            self.compiled_a_graph(time.perf_counter() - started, failed_guards[failures:],
                                  [now - before for now, before in zip(cache_hits(), hits)])
        return output

    def compiled_a_graph(self, seconds: float, failed_guards: list, hits: list) -> None:
        graphs = self.graphs
        graphs.count += 1
        graphs.seconds += seconds
        kind = "training" if torch.is_grad_enabled() else "evaluation"
        logger.info("tupe_ds: compiled the %s graph of %s in %.1f s (inductor's cache %s held "
                    "%d of its %d forward and backward graphs)", kind, graphs.name, seconds,
                    os.environ.get(CACHE_VARIABLE), hits[0], sum(hits))
        if graphs.count > PLANNED_GRAPHS:
            guards = "; ".join(reason.splitlines()[0] for reason in failed_guards) or "unknown"
            logger.warning("tupe_ds: %s compiled graph %d, beyond the plan of %d (training, "
                           "evaluation): the guard that failed: %s", graphs.name, graphs.count,
                           PLANNED_GRAPHS, guards)


def compiled_graphs(model: torch.nn.Module) -> list:
    """The Graphs of `model`'s compiled regions (modules' attributes named `region`), each once."""
    found = {}
    for module in model.modules():
        region = getattr(module, "region", None)
        if isinstance(region, CompiledRegion):
            found.setdefault(id(region.graphs), region.graphs)
    return list(found.values())


def summary(model: torch.nn.Module) -> Optional[str]:
    """One line on what `model`'s regions compiled on every rank (None where nothing is
    compiled): graphs, seconds and what inductor's cache held on rank 0, and the ranks where a
    compile failed. Every rank calls it (a gather in the default group, where one exists)."""
    found = compiled_graphs(model)
    failed = sorted({graphs.failure for graphs in found if graphs.failure})
    ranks = [failed]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, failed)
    if not found:
        return None
    eager = {rank: failures for rank, failures in enumerate(ranks) if failures}
    if eager:
        where = "" if len(ranks) == 1 else \
            f" on rank{'s' * (len(eager) > 1)} {', '.join(map(str, eager))} of {len(ranks)}"
        errors = sorted({error for failures in eager.values() for error in failures})
        return (f"torch.compile failed{where}, which ran eager from then on: "
                f"{'; '.join(errors)}")
    count = sum(graphs.count for graphs in found)
    hits, misses = cache_hits()
    return (f"torch.compile: {count} graph{'s' * (count != 1)} in "
            f"{sum(graphs.seconds for graphs in found):.1f} s; inductor's cache "
            f"{os.environ.get(CACHE_VARIABLE, '(of this node)')} held {hits} of the "
            f"{hits + misses} forward and backward graphs")
