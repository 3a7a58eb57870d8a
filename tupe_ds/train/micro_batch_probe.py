"""One probe of --micro-batch auto: the forward and backward of a synthetic micro-batch, and the
memory it takes on a GPU or a CPU with the model states DeepSpeed adds.

A probe is the forward and backward of a synthetic micro-batch at the run's seq-len through the
objective (BERT: the masked-LM head on the labelled positions at the run's mask rate; ELECTRA:
generator and discriminator), in the run's precision (the model is built in it), with dropout
as trained, before the DeepSpeed engine exists (ZeRO-2 hooks every gradient once it does). It
runs eagerly where the model compiles its layers: nothing is compiled or recompiled for the
sizes probed, and an eager pass holds at least what a compiled one does. Each probe ends with the
gradients dropped and the allocator's cache emptied, and the random generators are as they were
before the first, so the run trains exactly as with that --micro-batch given.

A micro-batch fits when the pass's peak (on a GPU torch's peak of allocated bytes, weights
included; on a CPU the allocations torch's profiler records during the pass) plus the model
states the engine adds (DeepSpeed's own estimators) stays within the memory this process may
use, less HEADROOM.
"""

import contextlib
import itertools
import os
from typing import Callable

import psutil
import torch
from megatron.core import tensor_parallel
from torch._C._profiler import _EventType

from tupe_ds.data.masking import IGNORE_INDEX, chosen_count
from tupe_ds.distributed.launch import processes_on_this_node
from tupe_ds.distributed.parallel import to_device
from tupe_ds.model.layers import labelled_positions

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

    def empty_cache(self) -> None:
        torch.accelerator.empty_cache()


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

    def empty_cache(self) -> None:
        pass


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
