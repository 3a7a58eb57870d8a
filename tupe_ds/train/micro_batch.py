"""--micro-batch auto: the largest micro-batch that divides each rank's share of the global batch
and fits in memory, found at a run's first start by probing the model the run then trains.

A probe is the forward and backward of a synthetic micro-batch (`synthetic_batch`) through the
objective, in the run's precision, with dropout as trained, before the DeepSpeed engine exists
(ZeRO-2 hooks every gradient once it does). It runs eagerly where the model compiles its layers:
nothing is compiled or recompiled for the sizes probed, and an eager pass holds at least what a
compiled one does. The random generators end as they were before the first probe, so the run
trains exactly as with that --micro-batch given. A size fits when the pass's peak (DeviceMemory,
HostMemory) plus the model states the engine adds (`model_state_bytes`) stays within the memory
this process may use, less HEADROOM.

Activation memory grows linearly with the micro-batch, so the search (`largest_fitting`) probes
1, 2, then the largest predicted to fit, each choice measured. No probe of a size predicted not
to fit runs: an out-of-memory inside a pass would leave tensor-parallel partners waiting in a
collective (on a GPU it still only means "does not fit"). Every rank takes the tightest rank's
figures (`agreed`), so all probe the same sizes in the same order and end with the same
micro-batch, the largest that fits on all of them, which DeepSpeed needs.

OUT/run.json records the choice with the layout it was made for; a later start that resumes a
checkpoint of the run on that layout keeps it without probing, any other start probes again and
says why (`not_kept_because`). An explicit --micro-batch N skips all of this. With --pp > 1
`auto` is refused before any work (ds_config.py): a pipeline stage's memory depends on the
micro-batches its schedule holds.
"""

import contextlib
import dataclasses
import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from torch._C._profiler import _EventType

from tupe_ds.data.masking import IGNORE_INDEX, chosen_count
from tupe_ds.distributed.launch import processes_on_this_node
from tupe_ds.distributed.parallel import to_device
from tupe_ds.model.layers import labelled_positions
from tupe_ds.tools.errors import Refused
from tupe_ds.train.ds_config import micro_batch_candidates, with_micro_batch
from tupe_ds.train.run_folder import description as folder_description

# Of the memory a process may use, kept free of what the probe counts: the caching allocator's
# fragmentation, DeepSpeed's reduce and all-gather buckets (100 MB each in fp16 with the shipped
# 5e7-element buckets), NCCL's buffers, the evaluation's batches. 8 GB of an 80 GB GPU.
HEADROOM = 0.10
GIB = 2**30


class DeviceMemory:
    """A GPU's: torch's peak of allocated bytes during the pass (the weights included), against
    the device's memory less what is not torch's (the CUDA context, other processes) and the
    headroom."""

    where = "of this GPU's memory"

    def __init__(self, device: torch.device, headroom: float):
        self.device = device
        free, total = torch.accelerator.get_memory_info(device)
        others = total - free - torch.accelerator.memory_reserved(device)
        self.budget = total * (1 - headroom) - others

    def peak(self, work: Callable[[], None]) -> float:
        torch.accelerator.reset_peak_memory_stats(self.device)
        work()
        return torch.accelerator.max_memory_allocated(self.device)


class HostMemory:
    """A CPU's: torch keeps no peak for its CPU allocator, so the peak is the running sum of the
    allocations torch's profiler records during the pass; against this node's available memory
    shared by the run's processes on it, less the headroom. The weights were allocated before:
    neither side counts them."""

    where = "of this node's available memory per process"

    def __init__(self, headroom: float):
        # kineto prints "profiler_start" and "profiler_stop" on stderr at every profile, at a
        # level above its error level: quiet them unless the user chose a level
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.budget = psutil.virtual_memory().available / processes_on_this_node() * (1 - headroom)

    def peak(self, work: Callable[[], None]) -> float:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as profile:
            work()
        allocations = sorted(allocation_events(
            profile.profiler.kineto_results.experimental_event_tree()),
            key=lambda event: event.start_time_ns)
        return max(itertools.accumulate(event.extra_fields.alloc_size for event in allocations),
                   default=0)


def allocation_events(events) -> list:
    """The allocations and frees (negative sizes) among profiler events and their children."""
    found = []
    for event in events:
        if event.tag == _EventType.Allocation:
            found.append(event)
        found += allocation_events(event.children)
    return found


def model_state_bytes(model: torch.nn.Module, zero: dict, dp: int) -> float:
    """What the engine adds to the weights the probe held: DeepSpeed's estimate of the model
    states on one rank (16-bit weights and gradients, fp32 weights and gradients, Adam's two
    moments, split as the ZeRO stage splits them over the dp ranks), less the weights it counts.
    stage_1_and_2.py's estimator serves stages 1 and 2 (stage 1 keeps whole 16-bit gradients,
    which the probe's peak holds); stage 0 partitions nothing: one rank's share is all."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params, largest_layer = model_to_params(model)
    stage = zero.get("stage", 0)
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    if stage == 3:
        offload_params = zero.get("offload_param", {}).get("device", "none") != "none"
        _, states, _ = estimate_zero3_model_states_mem_needs(
            params, largest_layer, num_gpus_per_node=dp, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params)
    else:
        _, states = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=dp if stage else 1, cpu_offload=offload_optimizer)
    weights = sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())
    return max(0, states - weights)


def synthetic_batch(run, objective, micro_batch: int) -> dict:
    """Rows of seq-len random ids with the run's mask rate of the tokens between [CLS] and [SEP]
    labelled (as many as the data stream labels: masking.chosen_count), the last token of the
    last row padding so that the padded path runs (most training batches have padding) at nearly
    every token; ELECTRA's generator draws too. From a generator of its own."""
    generator = torch.Generator().manual_seed(run.seed)
    ids = torch.randint(0, run.models[0].vocab_size, (micro_batch, run.seq_len),
                        generator=generator)
    labels = torch.full_like(ids, IGNORE_INDEX)
    count = int(chosen_count(run.seq_len - 2, run.masking.probability))
    labels[:, 1:1 + count] = ids[:, 1:1 + count]
    attention_mask = torch.ones_like(ids)
    attention_mask[-1, -1] = 0
    batch = {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
    if objective.generator_draws:
        batch["generator_draws"] = (labels != IGNORE_INDEX).float() * 0.5
    return batch


def training_pass(model, objective, batch: dict, device: torch.device) -> None:
    """Forward and backward of `batch` as a training step runs them (steps.EngineSteps), on the
    bare model; the loss divided by the batch's own counts (the same memory as the step's)."""
    labelled = labelled_positions(batch["labels"])
    batch = {name: to_device(value, device) for name, value in {**batch,
                                                                "labelled": labelled}.items()}
    loss, _ = objective.forward(model, batch, batch["attention_mask"], None)
    loss.backward()


@contextlib.contextmanager
def random_state_kept(device: torch.device):
    """The default generators and the tensor-parallel tracker's states as they were before."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        yield
    tracker.set_states(states)


@dataclass(frozen=True)
class Probe:
    """One micro-batch probed, as every rank sees it: the bytes the tightest rank needs (inf:
    out of memory) and may use."""
    micro_batch: int
    needed: float
    budget: float

    @property
    def over(self) -> float:
        return self.needed - self.budget

    @property
    def fits(self) -> bool:
        return self.over <= 0


def agreed(micro_batch: int, needed: float, budget: float, device: torch.device) -> Probe:
    """The probe as every rank sees it: the figures of the rank furthest over (or least under)
    its memory, gathered from all."""
    mine = torch.tensor([needed, budget], dtype=torch.float64, device=device)
    figures = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(figures, mine)
    tightest = max(figures, key=lambda pair: (pair[0] - pair[1]).item())
    return Probe(micro_batch, *tightest.tolist())


def predicted(fitting: list, micro_batch: int) -> float:
    """How far over its memory the tightest rank would be at `micro_batch` (bytes; at most 0:
    it fits), on the line through the two largest probes that fit."""
    below, above = fitting[-2], fitting[-1]
    slope = (above.over - below.over) / (above.micro_batch - below.micro_batch)
    return above.over + slope * (micro_batch - above.micro_batch)


def largest_fitting(sizes: list, probe: Callable[[int], Probe]) -> tuple:
    """(index in `sizes` (ascending) of the largest that fits, -1 for none; the probes made).
    The two smallest first, then the largest predicted to fit between the largest known to fit
    and the smallest known not to; none predicted ends the search."""
    made, fitting = [], []
    low, high = -1, len(sizes)
    while high - low > 1:
        if len(fitting) < 2:
            index = low + 1
        else:
            index = max((i for i in range(low + 1, high)
                         if predicted(fitting, sizes[i]) <= 0), default=None)
            if index is None:
                break
        made.append(probe(sizes[index]))
        if made[-1].fits:
            low = index
            fitting.append(made[-1])
        else:
            high = index
    return low, made


def size_text(size: float) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


def needs_text(probe: Probe, where: str) -> str:
    if math.isinf(probe.needed):
        return f"{probe.micro_batch} runs out of memory"
    return (f"{probe.micro_batch} needs {size_text(probe.needed)} of {size_text(probe.budget)} "
            f"{where}")


def search_text(sizes: list, chosen: int, made: list, where: str, run, seconds: float) -> str:
    """Why `sizes[chosen]`: what it needs, what the next size needs or would need."""
    share = run.batch_split.global_batch // run.batch_split.dp
    fit = next(p for p in made if p.micro_batch == sizes[chosen])
    text = (f"the largest of {', '.join(map(str, sizes))} (divisors of each rank's {share} "
            f"samples{' the batch ramp allows' if run.batch_split.ramp else ''}) that fits at seq "
            f"{run.seq_len} with {HEADROOM:.0%} headroom: {needs_text(fit, where)}")
    if chosen + 1 < len(sizes):
        after = sizes[chosen + 1]
        probed = next((p for p in made if p.micro_batch == after), None)
        fitting = [p for p in made if p.fits]
        text += (f", {needs_text(probed, where)}" if probed else
                 f", {after} would need "
                 f"{size_text(predicted(fitting, after) + fitting[-1].budget)} (on the line "
                 f"through {fitting[-2].micro_batch} and {fitting[-1].micro_batch})")
    return text + f"; {len(made)} probes in {seconds:.1f} s"


def nothing_fits(first: Probe, states: float, where: str, run) -> str:
    """What to change when not even the smallest micro-batch fits."""
    stage = run.ds_config.get("zero_optimization", {}).get("stage", 0)
    sharding = " or ".join(str(higher) for higher in (2, 3) if higher > stage)
    return (f"--micro-batch auto: not even micro-batch {first.micro_batch} fits at seq "
            f"{run.seq_len} with {HEADROOM:.0%} headroom on every rank ({needs_text(first, where)}"
            f"; the model states {size_text(states)} by DeepSpeed's estimate for ZeRO stage "
            f"{stage} over {run.dp_size} data-parallel rank(s)): "
            + (f"shard them with --zero-stage {sharding}, " if sharding else "")
            + "spread them over more GPUs, split the model with --tp, shorten --seq-len, or give "
            "--micro-batch N to train without the probe")


def probed_choice(run, model, objective, device: torch.device,
                  limit: Optional[float] = None) -> dict:
    """The largest micro-batch that fits on every rank, as run.json records it; Refused when
    none does. `limit`: the bytes a process may use, in place of what its memory allows."""
    meter = HostMemory(HEADROOM) if device.type == "cpu" else DeviceMemory(device, HEADROOM)
    budget = meter.budget if limit is None else limit
    states = model_state_bytes(model, run.ds_config.get("zero_optimization", {}), run.dp_size)
    sizes = micro_batch_candidates(run.batch_split.global_batch, run.dp_size, run.batch_split.ramp)

    def probe(micro_batch: int) -> Probe:
        batch = synthetic_batch(run, objective, micro_batch)
        try:
            needed = meter.peak(lambda: training_pass(model, objective, batch, device)) + states
        except torch.OutOfMemoryError:
            needed = math.inf
        # outside the handler: its traceback holds the pass's tensors until it ends
        model.zero_grad(set_to_none=True)
        if device.type != "cpu":
            torch.accelerator.empty_cache()
        return agreed(micro_batch, needed, budget, device)

    started = time.perf_counter()
    model.train()
    with random_state_kept(device), torch.compiler.set_stance("force_eager"):
        chosen, made = largest_fitting(sizes, probe)
    if chosen < 0:
        raise Refused(nothing_fits(made[0], states, meter.where, run))
    return {"micro_batch": sizes[chosen],
            "why": search_text(sizes, chosen, made, meter.where, run,
                               time.perf_counter() - started),
            "probes": [[p.micro_batch, None if math.isinf(p.needed) else int(p.needed)]
                       for p in made],
            "budget_bytes": int(made[0].budget), "headroom": HEADROOM}


def layout_of(run, device: torch.device) -> dict:
    """What a choice depends on: the models and objective, and how the work is split."""
    ramp = run.batch_split.ramp
    return {"world_size": run.world_size, "tp": run.layout.tp, "pp": run.layout.pp,
            "global_batch": run.batch_split.global_batch, "seq_len": run.seq_len,
            "zero_stage": run.ds_config.get("zero_optimization", {}).get("stage", 0),
            "precision": run.models[0].dtype, "rampup_batch_size": str(ramp) if ramp else None,
            "device": device_name(device), "objective": run.objective,
            "models": [dataclasses.asdict(config) for config in run.models]}


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    total = torch.accelerator.get_memory_info(device)[1]
    name = torch.get_device_module(device.type).get_device_name(device)
    return f"{name}, {total / GIB:.0f} GiB"


def recorded(out: str) -> Optional[dict]:
    """The auto choice OUT/run.json records (None: none, or no readable run.json)."""
    try:
        entry = folder_description.read(out).get("micro_batch")
    except ValueError:
        return None
    auto = entry.get("auto") if isinstance(entry, dict) else None
    if not (isinstance(auto, dict) and type(auto.get("micro_batch")) is int
            and isinstance(auto.get("layout"), dict) and isinstance(auto.get("why"), str)):
        return None
    return auto


def kept_everywhere(micro_batch: int, device: torch.device) -> bool:
    """Whether every rank keeps the same recorded micro-batch (0: this rank keeps none)."""
    figures = torch.tensor([micro_batch, -micro_batch], dtype=torch.int64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures[0].item() == -figures[1].item() > 0


def not_kept_because(before: dict, layout: dict, run) -> str:
    """Why run.json's choice is not this start's ("" where it is): a choice is kept when the run
    resumes a checkpoint of its own, trained at that size, on the layout it was made for."""
    split = run.batch_split
    if not (run.resume_plan is not None and run.resume_plan.candidates):
        return (f"run.json's choice of {before['micro_batch']} has no checkpoint of this run "
                "behind it (a first step that ran out of memory, another model)")
    if before["layout"] != layout:
        return (f"the layout changed since run.json's choice of {before['micro_batch']} "
                f"({changes(before['layout'], layout)})")
    if before["micro_batch"] not in micro_batch_candidates(split.global_batch, split.dp,
                                                           split.ramp):
        return (f"run.json's choice of {before['micro_batch']} does not divide each rank's "
                f"{split.global_batch // split.dp} samples")
    return ""


def changes(before: dict, now: dict) -> str:
    return ", ".join("the models" if name == "models" else
                     f"{name} {before.get(name)} -> {value}" for name, value in now.items()
                     if before.get(name) != value)


def settled(run, model, objective, device: torch.device, limit: Optional[float] = None):
    """`run` with its micro-batch chosen where it is `auto`: kept from run.json for the same
    layout, else probed on `model` (the model the engine then gets); the same on every rank, and
    written into run.ds_config for DeepSpeed. Refused when nothing fits. `limit`: see
    probed_choice."""
    split = run.batch_split
    if split.micro_batch is not None:
        return run
    layout = layout_of(run, device)
    before = recorded(run.out)
    not_kept = before is not None and not_kept_because(before, layout, run)
    if kept_everywhere(before["micro_batch"] if before and not not_kept else 0, device):
        choice, note = before, f"auto, kept from run.json for this layout: {before['why']}"
    else:
        choice = {**probed_choice(run, model, objective, device, limit), "layout": layout}
        note = f"auto: {choice['why']}"
        if not_kept:
            note += f"; probed again: {not_kept}"
    return dataclasses.replace(run, batch_split=with_micro_batch(
        run.ds_config, split, choice["micro_batch"], note, auto=choice))
