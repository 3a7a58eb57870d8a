"""One optimizer step in phases, and what each phase asks of the host and the device.

The phases: each micro-batch's `forward`; the `backward` of every micro-batch but the last (with,
for ours, DeepSpeed's step() call that only counts it); the `boundary`: the last micro-batch's
backward with the optimizer step (gradients reduced, clipped, applied, zeroed). Per phase:
- Python calls (sys.setprofile's 'call' and 'c_call' events, what cProfile counts):
  deterministic, the measure of host work that no machine's noise moves; and the Python frames
  among them ('call' only: functions written in Python, without the builtins a compiled graph's
  runtime calls for each of its buffers and saved tensors, which cost a fraction as much);
- host ms (perf_counter at each phase's start, no synchronisation: on CUDA the time the host
  takes to issue the work, which the GPU waits on when it is longer than the device ms);
- on CUDA, device ms: CUDA events recorded at the same marks.
Figures are per micro-batch (the mean over a step's occurrences of the phase), `micro_batch`
(forward + backward: a micro-batch away from the boundary) and `step` (every phase of the step).
"""

import statistics
import sys
import threading
import time

import torch

PHASES = ("forward", "backward", "boundary")


def no_mark(phase) -> None:
    pass


def run_step(runner, mark=no_mark) -> None:
    """One optimizer step of `runner` (forward(batch), backward(loss, last) over runner.batches);
    mark(phase) as each phase starts, mark(None) at the end."""
    last = len(runner.batches) - 1
    for i, batch in enumerate(runner.batches):
        mark("forward")
        loss = runner.forward(batch)
        mark("boundary" if i == last else "backward")
        runner.backward(loss, i == last)
    mark(None)


def per_micro_batch(occurrences: list) -> dict:
    """[(phase, amount)] of one step -> each phase's mean, `micro_batch` (forward + backward, when
    the step has more than one micro-batch) and `step` (the sum)."""
    figures = {phase: statistics.fmean(a for p, a in occurrences if p == phase)
               for phase in PHASES if any(p == phase for p, _ in occurrences)}
    if "backward" in figures:
        figures["micro_batch"] = figures["forward"] + figures["backward"]
    figures["step"] = sum(a for _, a in occurrences)
    return figures


def median_figures(steps: list) -> dict:
    """Each figure's median over steps (dicts of per_micro_batch)."""
    return {key: statistics.median(step[key] for step in steps) for key in steps[0]}


class CallCounter:
    """Python calls and frames per phase occurrence. Counted in every thread where Python has
    threading.setprofile_all_threads (3.12+); before that in the calling thread only, which on a
    CPU is where autograd runs the backward (on CUDA it runs it in a thread of its own)."""

    ALL_THREADS = hasattr(threading, "setprofile_all_threads")

    def __init__(self):
        self.phase, self.counts, self.occurrences = None, {"calls": 0, "python_frames": 0}, []

    def mark(self, phase) -> None:
        if self.phase is not None:
            self.occurrences.append((self.phase, self.counts))
        self.phase, self.counts = phase, {"calls": 0, "python_frames": 0}

    def profile(self, frame, event, arg) -> None:
        if event == "call":
            self.counts["calls"] += 1
            self.counts["python_frames"] += 1
        elif event == "c_call":
            self.counts["calls"] += 1

    def count(self, runner) -> dict:
        """One step's {"calls": per_micro_batch, "python_frames": per_micro_batch}."""
        install = threading.setprofile_all_threads if self.ALL_THREADS else sys.setprofile
        install(self.profile)
        try:
            run_step(runner, self.mark)
        finally:
            install(None)
        return {figure: per_micro_batch([(phase, counts[figure])
                                         for phase, counts in self.occurrences])
                for figure in ("calls", "python_frames")}


def count_calls(runner) -> dict:
    return CallCounter().count(runner)


class PhaseClock:
    """Host time (perf_counter) and, on CUDA, a recorded CUDA event at each phase's start."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self, phase) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), event))

    def occurrences(self) -> dict:
        """{"host_ms": [(phase, ms)], "device_ms": ... (CUDA)}; the events must have completed."""
        pairs = list(zip(self.marks, self.marks[1:]))
        out = {"host_ms": [(p, (t1 - t0) * 1e3) for (p, t0, _), (_, t1, _) in pairs]}
        if self.cuda:
            out["device_ms"] = [(p, e0.elapsed_time(e1)) for (p, _, e0), (_, _, e1) in pairs]
        return out


def time_phases(runner, steps: int, cuda: bool, synchronize) -> dict:
    """Host ms (and on CUDA device ms) per phase: the median over `steps` steps, each started
    on an idle device."""
    measured = {}
    for _ in range(steps):
        clock = PhaseClock(cuda)
        synchronize()
        run_step(runner, clock.mark)
        synchronize()
        for key, occurrences in clock.occurrences().items():
            measured.setdefault(key, []).append(per_micro_batch(occurrences))
    return {key: median_figures(figures) for key, figures in measured.items()}
