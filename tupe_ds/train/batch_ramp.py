"""--rampup-batch-size START INCREMENT SAMPLES: Megatron-LM's batch ramp, computed by
megatron-core's own calculator. The global batch of a step is a function of the samples consumed
before it: START, growing by INCREMENT every SAMPLES / ((GLOBAL - START) / INCREMENT) samples, then
GLOBAL once SAMPLES are consumed. It grows in whole micro-batch x data-parallel steps (the
accumulation steps change, the micro-batch does not), so a resume in the middle of the ramp,
which restores the samples consumed, goes on with the same batches on any layout whose micro-batch
x dp divides START and INCREMENT."""

import threading
from dataclasses import dataclass

from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator


@dataclass(frozen=True)
class RampSettings:
    start: int
    increment: int
    samples: int

    def __str__(self) -> str:
        return f"{self.start} {self.increment} {self.samples}"


def check(ramp: RampSettings, global_batch: int, micro_batch: int, dp: int) -> str:
    """What is wrong with `ramp` for this global batch and layout ("" if nothing)."""
    flag = f"--rampup-batch-size {ramp}"
    step = micro_batch * dp
    if ramp.start >= global_batch:
        return (f"{flag}: START must be below the global batch {global_batch} the ramp grows to "
                "(--global-batch); leave the ramp out for a fixed batch")
    for name, value in (("START", ramp.start), ("INCREMENT", ramp.increment)):
        if value % step:
            return (f"{flag}: {name} {value} is not a multiple of micro-batch {micro_batch} x "
                    f"{dp} data-parallel ranks = {step}; the batch grows in whole micro-batches "
                    "of every rank: change it or --micro-batch")
    if (global_batch - ramp.start) % ramp.increment:
        return (f"{flag}: the global batch {global_batch} minus START {ramp.start} is not a "
                f"multiple of INCREMENT {ramp.increment}")
    return ""


class BatchRamp:
    """The global batch of the step that starts at global sample `consumed` (thread-safe: the
    prefetch thread reads ahead with it)."""

    def __init__(self, ramp: RampSettings, global_batch: int, micro_batch: int, dp: int):
        self.settings, self.final = ramp, global_batch
        self._calculator = RampupBatchsizeNumMicroBatchesCalculator(
            global_batch, micro_batch, dp, decrease_batch_size_if_needed=False, rank=-1,
            start_global_batch_size=ramp.start, batch_size_increment=ramp.increment,
            ramup_samples=ramp.samples)
        self._lock = threading.Lock()

    def __call__(self, consumed: int) -> int:
        with self._lock:
            self._calculator.update(consumed, consistency_check=True)
            return self._calculator.get_current_global_batch_size()
