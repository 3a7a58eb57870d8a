"""bench/gpu/step_time.py's measurements: the process group, the matmul peak, and the rows (build a runner,
time it, count what one step asks for, free it): the table, the ELECTRA pair, the ZeRO sweep,
each a generator of Builds, so that a caller can measure (or skip) one row at a time."""

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
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from bench.gpu.counts import count_ops, count_syncs
from bench.gpu.runners import (PADDINGS, HFRunner, OursRunner, TrainingStepRunner, ds_config,
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


def timed_steps(settings, step) -> list:
    synchronize = get_accelerator().synchronize
    for _ in range(settings.warmup):
        step()
    times = []
    for _ in range(settings.steps):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def free(runner, name: str) -> None:
    """Close the runner and give its memory back; warn if its model outlives it."""
    module = weakref.ref(runner.module())
    runner.close()
    del runner
    gc.collect()
    get_accelerator().empty_cache()
    if module() is not None:
        print(f"warning: {name} is still referenced after closing: the next models may run out "
              "of memory")


def measure(settings, model: str, padding: str, seq: int, micro: int, make_runner,
            profile: bool = True) -> dict:
    """Build, time, count, free: one row."""
    accelerator = get_accelerator()
    if settings.cuda:
        accelerator.reset_peak_memory_stats()
    runner = make_runner()
    times = timed_steps(settings, runner.step)
    seconds = statistics.median(times)
    row = {"name": f"{model}, {PADDINGS[padding]}", "model": model, "padding": padding,
           "seq": seq, "micro_batch": micro, "accumulation": settings.global_batch // micro,
           "ms_per_step": seconds * 1e3, "min_ms": min(times) * 1e3,
           "samples_per_s": settings.global_batch / seconds,
           "tflops": runner.flops / seconds / 1e12,
           "mfu": runner.flops / seconds / settings.peak_flops}
    if settings.cuda:
        row["peak_gib"] = accelerator.max_memory_allocated() / 2**30
    if hasattr(runner, "engine"):
        row["skipped_steps"] = runner.engine.skipped_steps
    if profile and padding in settings.profiled_paddings:
        row.update(count_ops(runner.step, settings.cuda, accelerator.synchronize))
        if settings.cuda:
            row.update(count_syncs(runner.step, accelerator.synchronize))
    free(runner, f"{row['name']} at seq {seq}")
    print(f"  {row['name']:<30} seq {seq:<4} micro {micro:<4} {row['ms_per_step']:9.1f} ms/step "
          f"{row['samples_per_s']:9.1f} samples/s", flush=True)
    return row


def ours_name(settings, encoding: str, attention: str) -> str:
    return encoding if len(settings.attention) == 1 else f"{encoding}/{attention}"


def batches_for(settings, seq: int, micro: int, padding: str) -> list:
    return make_batches(settings, seq, micro, settings.global_batch // micro, padding)


@dataclass
class Build:
    """One row to measure: its model, padding and shape, how to build its runner, and the fields
    its row adds (ELECTRA's config, the sweep's ZeRO stage)."""

    model: str
    padding: str
    seq: int
    micro: int
    make_runner: Callable
    profile: bool = True
    extra: dict = field(default_factory=dict)

    def measure(self, settings) -> dict:
        return {**measure(settings, self.model, self.padding, self.seq, self.micro,
                          self.make_runner, self.profile), **self.extra}


def table_builds(settings):
    """HF and each of our encodings at each seq, once per --padding."""
    for seq, micro in zip(settings.seqs, settings.micro_batches):
        config = ds_config(settings, micro)
        for padding in settings.padding:
            batches = batches_for(settings, seq, micro, padding)
            yield Build(HF, padding, seq, micro,
                        functools.partial(HFRunner, settings, seq, batches, config))
            for attention in settings.attention:
                for encoding in settings.encodings:
                    yield Build(ours_name(settings, encoding, attention), padding, seq, micro,
                                functools.partial(OursRunner, settings, seq, batches, encoding,
                                                  attention, config))


def sweep_builds(settings):
    """bert-a at the shortest seq for each ZeRO stage x micro-batch, with the first --padding."""
    seq, padding = min(settings.seqs), settings.padding[0]
    for stage in settings.sweep_zero_stages:
        for micro in settings.sweep_micro_batches:
            batches = batches_for(settings, seq, micro, padding)
            config = ds_config(settings, micro, zero_stage=stage)
            yield Build(f"bert-a zero{stage}", padding, seq, micro, functools.partial(
                OursRunner, settings, seq, batches, "bert-a", settings.attention[0], config),
                profile=False, extra={"zero_stage": stage})


def electra_builds(settings):
    """ELECTRA and the BERT of its discriminator's size at the shortest seq, once per --padding,
    each with its shipped config's micro-batch (on a CPU: the tiny pair, --micro-batches)."""
    if not settings.electra_encoding:
        return
    seq = min(settings.seqs)
    pairs = ELECTRA_ROWS["cuda" if settings.cuda else "cpu"].items()
    for padding in settings.padding:
        for name, (objective, presets, path) in pairs:
            config = ds_config(settings, None if settings.cuda else settings.micro_batches[0],
                               path=path)
            micro = config["train_micro_batch_size_per_gpu"]
            batches = batches_for(settings, seq, micro, padding)
            yield Build(name, padding, seq, micro, functools.partial(
                TrainingStepRunner, settings, objective, presets, seq, batches, config),
                extra={"config": path})


# bench/gpu/step_time.py's parts, in the order it runs them: the rows each measures, one Build at a time.
BUILDS = {"table": table_builds, "electra": electra_builds, "sweep": sweep_builds}
