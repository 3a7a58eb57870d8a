"""bench/gpu/step_time.py's measurements: the process group, the matmul peak, and the rows: build
a runner once, and for each of its micro-batches (smallest first) time it, the first also
profiled (what one step asks of the machine, phase by phase); a micro-batch that runs out of
memory is recorded as not fitting and ends the build's sweep; then free it. The table, the
ELECTRA pair and the ZeRO sweep are each a generator of Builds, so that a caller can measure (or
skip) one build at a time."""

import functools
import gc
import os
import platform
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from bench.gpu.counts import count_ops, count_syncs
from bench.gpu.phases import time_phases
from bench.gpu.runners import (PADDINGS, HFRunner, MicroBatchRunner, OursRunner,
                               TrainingStepRunner, config_micro_batch, ds_config,
                               make_batches)
from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import start_distributed
from tupe_ds.model.config import DTYPES
from tupe_ds.model.electra import PAIRS

HF = "hf-bert"
# The ELECTRA rows: name -> (objective, presets, shipped config), ELECTRA and the BERT of its
# discriminator's size; on a CPU the tiny pair with the same configs.
ELECTRA_CONFIG = "ds_configs/electra_base_fp16.json"
BERT_BASE_CONFIG = "ds_configs/bert_base_fp16.json"
ELECTRA_ROWS = {
    "cuda": {"electra-base": ("electra", PAIRS["electra-base"], ELECTRA_CONFIG),
             "bert-base": ("mlm", ("bert-base",), BERT_BASE_CONFIG)},
    "cpu": {"electra-tiny": ("electra", PAIRS["tiny"], ELECTRA_CONFIG),
            "bert-tiny": ("mlm", ("tiny",), BERT_BASE_CONFIG)},
}


def init_distributed(cuda: bool) -> None:
    """A 1-process group when started without a launcher (`python -m bench.gpu.step_time`)."""
    if not dist.is_initialized():
        launch.discover()
        start_distributed(get_accelerator().communication_backend_name() if cuda else "gloo")
    if dist.get_world_size() != 1:
        raise SystemExit("bench/gpu/step_time.py measures one GPU: run it with deepspeed --num_gpus 1")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def machine_name(settings) -> str:
    if settings.cuda:
        return torch.cuda.get_device_name(settings.device)
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"


def matmul_peak(settings) -> float:
    """FLOP/s of a plain n^3 matmul: in the run's dtype on CUDA, fp32 on a CPU."""
    n = settings.matmul_n
    dtype = DTYPES[settings.dtype] if settings.cuda else torch.float32
    a = torch.randn(n, n, device=settings.device, dtype=dtype)
    b = torch.randn(n, n, device=settings.device, dtype=dtype)
    repeats = 50 if settings.cuda else 10
    for _ in range(10 if settings.cuda else 1):  # on a GPU also to let the clocks rise
        a @ b
    get_accelerator().synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    get_accelerator().synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def timed_step(step) -> float:
    synchronize = get_accelerator().synchronize
    synchronize()
    start = time.perf_counter()
    step()
    synchronize()
    return time.perf_counter() - start


def dynamo_counts() -> dict:
    """torch.compile's graphs and graph breaks so far in this process."""
    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def free(runner, name: str) -> None:
    """Close the runner and give its memory back, and torch.compile's graphs (the next model
    compiles afresh: dynamo stops compiling a function after 8 versions and runs it eagerly;
    inductor's on-disk cache keeps what repeats cheap); warn if its model outlives it."""
    module = weakref.ref(runner.module())
    runner.close()
    del runner
    torch._dynamo.reset()
    gc.collect()
    get_accelerator().empty_cache()
    if module() is not None:
        print(f"warning: {name} is still referenced after closing: the next models may run out "
              "of memory")


def measure_micro(settings, build, runner, micro: int, profile: bool) -> dict:
    """One row: `runner` at `micro`, warmed up, timed; if `profile`, what one step asks for."""
    accelerator = get_accelerator()
    if settings.cuda:
        accelerator.reset_peak_memory_stats()
    compiled_before = dynamo_counts()
    warmup = [timed_step(runner.step) for _ in range(settings.warmup)]
    times = [timed_step(runner.step) for _ in range(settings.steps)]
    seconds = statistics.median(times)
    row = {**row_head(settings, build, micro, fits=True),
           "ms_per_step": seconds * 1e3, "min_ms": min(times) * 1e3,
           "samples_per_s": settings.global_batch / seconds,
           "tflops": runner.flops / seconds / 1e12,
           "mfu": runner.flops / seconds / settings.peak_flops,
           "warmup_s": warmup, "compile": getattr(runner, "compile", None),
           **{key: value - compiled_before[key] for key, value in dynamo_counts().items()}}
    if settings.cuda:
        row["peak_gib"] = accelerator.max_memory_allocated() / 2**30
    if hasattr(runner, "engine"):
        row["skipped_steps"] = runner.engine.skipped_steps
    if profile:
        row.update(count_ops(runner.step, settings.cuda, accelerator.synchronize))
        if isinstance(runner, MicroBatchRunner):  # a step made of phases (not EngineSteps')
            row["phase_ms"] = time_phases(runner, 1, settings.cuda, accelerator.synchronize)
        if settings.cuda:
            row.update(count_syncs(runner.step, accelerator.synchronize))
    print(f"  {row['name']:<30} seq {build.seq:<4} micro {micro:<4} {row['ms_per_step']:9.1f} "
          f"ms/step {row['samples_per_s']:9.1f} samples/s", flush=True)
    return row


def row_head(settings, build, micro: int, fits: bool) -> dict:
    return {"name": f"{build.model}, {PADDINGS[build.padding]}", "model": build.model,
            "padding": build.padding, "seq": build.seq, "micro_batch": micro,
            "accumulation": settings.global_batch // micro, "fits": fits, **build.extra}


def does_not_fit(settings, build, micro: int, error: Exception) -> dict:
    print(f"  {build.model}, {PADDINGS[build.padding]}: micro-batch {micro} at seq {build.seq} "
          "does not fit (out of memory)", flush=True)
    return {**row_head(settings, build, micro, fits=False), "error": str(error).splitlines()[0]}


def measure(settings, build, on_row=lambda row: None, more=lambda: True) -> list:
    """Build's rows, one per micro-batch, smallest first on one runner, each handed to
    `on_row` as soon as it is measured; the first profiled (if build.profile and its padding is
    profiled). An out-of-memory error makes that micro-batch's row a `fits: False` one and ends
    the sweep (a larger one would not fit either); so does `more()` saying no before the next
    micro-batch (a time budget spent)."""
    rows, runner = [], None
    try:
        for micro in build.micros:
            if rows and not more():
                break
            batches = batches_for(settings, build.seq, micro, build.padding)
            try:
                if runner is None:
                    runner = build.make_runner(micro, batches)
                else:
                    runner.use_batches(batches)
                profile = (not rows and build.profile
                           and build.padding in settings.profiled_paddings)
                rows.append(measure_micro(settings, build, runner, micro, profile))
            except torch.OutOfMemoryError as error:
                rows.append(does_not_fit(settings, build, micro, error))
            on_row(rows[-1])
            if not rows[-1]["fits"]:
                break
    finally:
        if runner is not None:
            free(runner, f"{build.model}, {PADDINGS[build.padding]} at seq {build.seq}")
        else:
            gc.collect()
            get_accelerator().empty_cache()
    return rows


def ours_name(settings, encoding: str, attention: str) -> str:
    return encoding if len(settings.attention) == 1 else f"{encoding}/{attention}"


def batches_for(settings, seq: int, micro: int, padding: str) -> list:
    return make_batches(settings, seq, micro, settings.global_batch // micro, padding)


@dataclass
class Build:
    """One model to build and measure at each of its micro-batches (smallest first, each a whole
    factor of the next): its name, padding and seq, make_runner(micro, batches), whether its
    first micro-batch is profiled, and the fields its rows add (ELECTRA's config, the sweep's
    ZeRO stage)."""

    model: str
    padding: str
    seq: int
    micros: list
    make_runner: Callable
    profile: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        """What its time is estimated from (bench/gpu/suite_budget.py): HF's model or ours."""
        return "hf" if self.model == HF else "ours"

    def measure(self, settings, on_row=lambda row: None, more=lambda: True) -> list:
        return measure(settings, self, on_row, more)


def micro_batches(settings, seq: int, model: str) -> list:
    """The table's micro-batches of `model` at `seq`: the like-for-like one (--micro-batches, the
    same for every model), then, for the --sweep-models, that times each --sweep-factors."""
    micro = settings.micro_batches[settings.seqs.index(seq)]
    factors = settings.sweep_factors if model in settings.sweep_models else []
    return [micro] + [micro * factor for factor in factors]


def table_builds(settings):
    """HF and each of our encodings at each seq, once per --padding. The order is what a cut
    run (bench/gpu/suite.py's budget) keeps first: the --sweep-models at every seq and padding
    (the headline: ours at its best against HF at its best), then the other encodings at the
    seq of the step-time targets, then at the others."""
    target = 512 if 512 in settings.seqs else max(settings.seqs)
    builds = []
    for seq in settings.seqs:
        for padding in settings.padding:
            builds.append(Build(HF, padding, seq, micro_batches(settings, seq, HF),
                                functools.partial(hf_runner, settings, seq)))
            for attention in settings.attention:
                for encoding in settings.encodings:
                    name = ours_name(settings, encoding, attention)
                    builds.append(Build(name, padding, seq, micro_batches(settings, seq, name),
                                        functools.partial(ours_runner, settings, seq, encoding,
                                                          attention, None)))
    return sorted(builds, key=lambda b: (0,) if b.model in (HF, *settings.sweep_models)
                  else (1, b.seq != target))


def hf_runner(settings, seq: int, micro: int, batches: list) -> HFRunner:
    return HFRunner(settings, seq, batches, ds_config(settings, micro))


def ours_runner(settings, seq: int, encoding: str, attention: str, zero_stage, micro: int,
                batches: list) -> OursRunner:
    return OursRunner(settings, seq, batches, encoding, attention,
                      ds_config(settings, micro, zero_stage), settings.compile)


def sweep_builds(settings):
    """bert-a at the shortest seq for each ZeRO stage, one build swept over
    --sweep-micro-batches, with the first --padding."""
    seq, padding = min(settings.seqs), settings.padding[0]
    for stage in settings.sweep_zero_stages:
        yield Build(f"bert-a zero{stage}", padding, seq, settings.sweep_micro_batches,
                    functools.partial(ours_runner, settings, seq, "bert-a",
                                      settings.attention[0], stage),
                    profile=False, extra={"zero_stage": stage})


def electra_builds(settings):
    """ELECTRA and the BERT of its discriminator's size at the shortest seq, once per --padding,
    each with its shipped config's micro-batch, or where that is "auto" swept as the table's
    models are (on a CPU: the tiny pair, --micro-batches)."""
    if not settings.electra_encoding:
        return
    seq = min(settings.seqs)
    pairs = ELECTRA_ROWS["cuda" if settings.cuda else "cpu"].items()
    for padding in settings.padding:
        for name, (objective, presets, path) in pairs:
            shipped = config_micro_batch(path) if settings.cuda else settings.micro_batches[0]
            micros = [shipped]
            if shipped == "auto":
                like_for_like = settings.micro_batches[settings.seqs.index(seq)]
                micros = [like_for_like * f for f in [1, *settings.sweep_factors]]

            def runner(micro, batches, objective=objective, presets=presets, path=path):
                return TrainingStepRunner(settings, objective, presets, seq, batches,
                                          ds_config(settings, micro, path=path))
            yield Build(name, padding, seq, micros, runner, extra={"config": path})


# bench/gpu/step_time.py's parts, in the order it runs them: the rows each measures, one Build at a time.
BUILDS = {"table": table_builds, "electra": electra_builds, "sweep": sweep_builds}
