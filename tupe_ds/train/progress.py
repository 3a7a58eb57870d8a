"""The lines rank 0 prints of a start: what it starts, the progress line every --log-interval
steps with its ETA and MFU, and the summary at its end. Monitor.train (monitor.py) measures the
figures and logs them; here they become text.

Nothing here waits for the device: the loss and the grad norm were read to the host by the time
the line is made, and the memory figures are the caching allocator's host-side counters.
"""

import collections
import os
from typing import Optional

import torch

from tupe_ds.train.schedule import schedule_text

# Peak dense bf16/fp16 tensor-core TFLOPS by a part of torch.cuda.get_device_name(), the most
# specific first (NVIDIA's datasheets, whose headline figures are with 2:4 sparsity: twice these).
# No fp32 entries: a run in fp32 shows no MFU.
PEAK_TFLOPS = (("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4),
               ("H200 NVL", 835.5), ("H200", 989.4), ("A100", 312.0))


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The device's peak dense rate for the run's precision (bf16, fp16, fp32); None unknown."""
    if precision not in ("bf16", "fp16"):
        return None
    return next((peak for part, peak in PEAK_TFLOPS if part in device_name), None)


def mfu_percent(tflops_per_gpu: float, device_name: str, precision: str) -> Optional[float]:
    """Model FLOPs utilisation: the achieved rate (Megatron's formula, monitor.flops_per_step)
    over the device's peak for the precision, in %; None where the peak is not known."""
    peak = peak_tflops(device_name, precision)
    return None if peak is None else 100 * tflops_per_gpu / peak


def no_mfu_note(device_name: str, precision: str) -> str:
    return (f"tupe-pretrain: no MFU on the progress line: no peak {precision} rate is known for "
            f"{device_name} (PEAK_TFLOPS in tupe_ds/train/progress.py)")


def cuda_memory(device) -> dict:
    """The most memory torch's caching allocator held on `device` since the last call, GiB, as
    scalars; the peaks start again from here."""
    values = {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
              "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return values


class Eta:
    """Seconds to the run's last step: the steps left times the seconds a step takes, estimated
    as the training seconds per step over the last WINDOW log intervals (recent ones: a start's
    first steps, slowed by warming up, fade out) plus this start's evaluation and checkpoint
    seconds spread over its steps so far (they come back every --eval-interval and
    --save-interval). The caller counts the steps left from its own step: a resumed run's."""

    WINDOW = 10

    def __init__(self):
        self.recent = collections.deque(maxlen=self.WINDOW)  # (steps, training seconds)
        self.steps = 0
        self.paused = 0.0

    def add(self, steps: int, trained: float, paused: float) -> None:
        """A log interval of `steps` steps: `trained` seconds of steps, `paused` of evaluation
        and saves."""
        self.recent.append((steps, trained))
        self.steps += steps
        self.paused += paused

    def seconds(self, steps_left: int) -> float:
        recent_steps = sum(steps for steps, _ in self.recent)
        per_step = sum(trained for _, trained in self.recent) / recent_steps
        return steps_left * (per_step + self.paused / self.steps)


def clock(seconds: float) -> str:
    """H:MM:SS, the hours as many as there are."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{seconds:02}"


def line(step: int, steps: Optional[int], values: dict) -> str:
    """The progress line of Monitor.train's logged `values` at `step` of `steps` (the run's
    --steps), its fields between ` | ` as Megatron's and the step right-aligned to the width of
    --steps, so that lines stack. The GPU's figures (TFLOPS, MFU, rank 0's memory) where `values`
    has its memory; grad norm, loss scale and ETA where they are known. Elapsed: since this
    start's process started. Skipped: DeepSpeed's count of the steps it did not apply, over the
    run; with fp16 it counts the loss scaler's overflows too, and the ones that count towards
    --max-nonfinite-steps follow in brackets where fewer."""
    width = len(str(steps or step))
    fields = [f"step {step:>{width}}" + (f"/{steps}" if steps else ""),
              f"loss {values['train/loss']:.4f}", f"lr {values['train/lr']:.3e}"]
    if "train/grad_norm" in values:
        fields.append(f"grad norm {values['train/grad_norm']:.3f}")
    if "train/loss_scale" in values:
        fields.append(f"loss scale {values['train/loss_scale']:g}")
    fields += [f"{values['throughput/samples_per_s']:.1f} samples/s",
               f"{values['throughput/tokens_per_s']:.0f} tokens/s"]
    if "memory/max_allocated_gib" in values:
        fields.append(f"{values['throughput/tflops_per_rank']:.1f} TFLOPS/GPU")
        if "throughput/mfu_percent" in values:
            fields.append(f"MFU {values['throughput/mfu_percent']:.1f}%")
        fields.append(f"memory {values['memory/max_allocated_gib']:.2f} GiB "
                      f"({values['memory/max_reserved_gib']:.2f} reserved)")
    fields.append(f"elapsed {clock(values['time/elapsed_seconds'])}")
    if "time/eta_seconds" in values:
        fields.append(f"ETA {clock(values['time/eta_seconds'])}")
    skipped, nonfinite = values["train/skipped_steps"], values["train/nonfinite_steps"]
    fields.append(f"skipped {skipped}" + (f" ({nonfinite} not finite)" if nonfinite < skipped
                                          else ""))
    return " | ".join(fields)


def summary(step: int, steps: int, first_step: int, valid_loss: float, best: tuple,
            wall_seconds: float, training_seconds: float, out: str,
            checkpoint: Optional[str]) -> str:
    """The lines rank 0 says when a start ends at `step` of `steps`, having resumed after
    `first_step` - 1 (or started): `best` is the run's (step, valid loss) lowest,
    `training_seconds` its training time as its last log line has it, `checkpoint` the newest
    one's tag (None: none written)."""
    trained = f"steps {first_step}-{step}" if step >= first_step else "no step"
    newest = os.path.join(out, "checkpoints", checkpoint) if checkpoint else "none written"
    return "\n".join([
        f"final valid loss {valid_loss:.4f} at step {step}",
        f"this start trained {trained} of {steps} in {clock(wall_seconds)} (wall time since "
        f"its process started); the run's training time {clock(training_seconds)}",
        f"best valid loss {best[1]:.4f} at step {best[0]}",
        f"newest checkpoint {newest}",
        f"log {os.path.join(out, 'train_log.jsonl')}",
        f"tensorboard --logdir {os.path.join(out, 'tensorboard')}"])


def started_by(world_size: int, launcher: str) -> str:
    return ("1 process, no launcher" if launcher == "single process"
            else f"{world_size} processes from {launcher}")


def start_line(run, step: int, plan, branched: bool, launcher: str, train) -> str:
    """The line that says what a start trains as its steps begin: from where (resumed at `step`
    of `plan`'s checkpoint, branched, or from step 0), the models, the processes, the batch,
    the samples, the loss, the masking, the learning rate, and the training stream `train`."""
    start = ("resumed at" if plan else f"branched from {run.init_plan.step_dir} at" if branched
             else "starting")
    return (f"{start} step {step} of {run.steps}: {run.objective} "
            f"{run.model} {run.models[0].pos_encoding}, {started_by(run.world_size, launcher)} "
            f"({run.layout}), {run.batch_split}, samples of {run.seq_len} tokens, loss normalised "
            f"{run.loss_normalization}, {run.masking}, learning rate "
            f"{schedule_text(run.ds_config)}, {train.description(run.sources)}")
