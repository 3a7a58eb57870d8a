"""What one training step asks of the machine, counted: leaf aten operators (torch.profiler; a
CPU-side proxy for kernel launches, and on CUDA the launches), tupe_ds's named phases, and on
CUDA the host synchronisations (torch.cuda.set_sync_debug_mode("warn")) and where they come
from."""

import collections
import os
import traceback
import warnings

import torch

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
SYNC_WARNING = "synchroniz"  # in the message of torch.cuda.set_sync_debug_mode("warn")


def leaf_aten_ops(events) -> collections.Counter:
    """Aten events with no aten descendant, less NO_KERNEL_OPS, by name."""
    not_leaf = set()
    for event in events:
        if event.name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if parent is not None:
                not_leaf.add(id(parent))
    return collections.Counter(e.name for e in events if e.name.startswith("aten::")
                               and id(e) not in not_leaf and e.name not in NO_KERNEL_OPS)


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
    saw and the device's busy time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
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
        result["device_busy_ms"] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return result


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
