"""What one training step asks of the machine, counted: leaf aten operators (torch.profiler; a
CPU-side proxy for kernel launches, and on CUDA the launches), tupe_ds's named phases, and on
CUDA the device's busy time (the union of its kernel intervals), the host synchronisations
(torch.cuda.set_sync_debug_mode("warn")) and where they come from."""

import collections
import os
import traceback
import warnings

import torch
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Leaf aten operators that launch no kernel: views and metadata, allocations without a fill, and
# contiguous/reshape/to when they copy nothing (when they copy, the copy is their aten child and is
# counted instead). DeepSpeed's compiled extensions (FusedAdam) are no aten operators: not counted.
NO_KERNEL_OPS = {f"aten::{name}" for name in (
    "view", "_unsafe_view", "view_as", "as_strided", "as_strided_", "_reshape_alias", "reshape",
    "detach", "detach_", "alias", "resolve_conj", "resolve_neg", "empty", "empty_strided",
    "empty_like", "resize_", "lift_fresh", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "flatten", "unflatten", "movedim", "contiguous", "to", "set_", "result_type", "size",
    "stride", "dim", "is_same_size", "_has_compatible_shallow_copy_type")}
PHASES = ("step/", "electra/")  # torch.profiler ranges of tupe_ds.train.steps and model.electra
STEP_RANGE = "bench/step"  # the profiled step, as a torch.profiler range
SYNC_WARNING = "synchroniz"  # in the message of torch.cuda.set_sync_debug_mode("warn")


def leaf_aten_ops(events) -> collections.Counter:
    """Aten events with no aten descendant that may launch a kernel, less NO_KERNEL_OPS, by name.
    An operator whose aten descendants are all NO_KERNEL_OPS (allocations, views: layer norm,
    attention, max) is a leaf: its kernel is its own."""
    launching_below = set()  # ids of the events with a descendant outside NO_KERNEL_OPS
    for event in events:
        if event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS:
            parent = event.cpu_parent
            while parent is not None and id(parent) not in launching_below:
                if parent.name.startswith("aten::"):
                    launching_below.add(id(parent))
                parent = parent.cpu_parent
    return collections.Counter(e.name for e in events if e.name.startswith("aten::")
                               and id(e) not in launching_below and e.name not in NO_KERNEL_OPS)


def union_us(intervals) -> float:
    """The time covered by (start, end) intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def device_busy(events, span_name: str) -> dict:
    """The device's busy time in the profiled range `span_name`: the union of its kernel and
    copy intervals (kernels of concurrent streams overlap: a sum would count them twice), and
    that time over the span from the range's start on the host to the later of its end and the
    last kernel's."""
    kernels = [e.time_range for e in events  # profiler ranges show on the GPU's timeline too
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    span = next(e.time_range for e in events
                if e.name == span_name and e.device_type == DeviceType.CPU)
    end = max([span.end] + [k.end for k in kernels])
    busy = union_us((k.start, k.end) for k in kernels)
    return {"device_busy_ms": busy / 1e3, "device_span_ms": (end - span.start) / 1e3,
            "device_busy_fraction": busy / (end - span.start)}


def phase_times(events) -> dict:
    """tupe_ds's named phases (EngineSteps, ELECTRA's forward): host ms and calls."""
    phases = {}
    for event in events:
        if event.name.startswith(PHASES):
            phase = phases.setdefault(event.name, {"host_ms": 0.0, "calls": 0})
            phase["host_ms"] += event.cpu_time_total / 1e3
            phase["calls"] += 1
    return phases


def count_ops(step, cuda: bool, synchronize) -> dict:
    """Leaf aten operators of one step, its phases; on CUDA also the kernel launches the runtime
    saw, the device's busy time (device_busy) and where it goes (top_kernels)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP_RANGE):
            step()
        synchronize()
    events = prof.events()
    names = leaf_aten_ops(events)
    result = {"ops": sum(names.values()), "op_names": dict(names.most_common())}
    phases = phase_times(events)
    if phases:
        result["phases"] = phases
    if cuda:
        result["launches"] = sum(1 for e in events if "LaunchKernel" in e.name
                                 or e.name == "cudaGraphLaunch")
        result.update(device_busy(events, STEP_RANGE))
        result["top_kernels"] = top_kernels(prof.key_averages())
    return result


def top_kernels(averages, count: int = 12) -> list:
    """The operators and kernels with the most device time of their own: [name, ms, calls]."""
    busiest = sorted(averages, key=lambda a: -a.self_device_time_total)[:count]
    return [[a.key, a.self_device_time_total / 1e3, a.count] for a in busiest
            if a.self_device_time_total > 0]


def short_path(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else path


def count_syncs(step, synchronize) -> dict:
    """Host synchronisations of one step (CUDA only), by the first frame outside torch that asked
    for them."""
    torch_dir = os.path.dirname(torch.__file__)
    locations = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return
        where = f"{short_path(filename)}:{lineno}"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if not frame.filename.startswith(torch_dir) and frame.filename != warnings.__file__:
                where = f"{short_path(frame.filename)}:{frame.lineno}"
                break
        locations[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize()  # outside: this one is ours
    return {"syncs": sum(locations.values()), "sync_locations": dict(locations.most_common())}
