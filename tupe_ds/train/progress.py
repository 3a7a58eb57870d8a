"""The lines rank 0 prints of a start: what it starts, the progress line every --log-interval
steps with its ETA and MFU, and the summary at its end. Monitor.train (monitor.py) measures the
figures and logs them; here they become text.

Nothing here waits for the device: the loss and the grad norm were read to the host by the time
the line is made, and the memory figures are the caching allocator's host-side counters.
"""

import collections
import dataclasses
import os
from typing import Optional, Tuple

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


def count(number: float) -> str:
    """A count in 4 characters or so: 950, 53.9k, 1.23M, 4.56B (999,600: 1M, not 1e+03k)."""
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= 0.9995 * limit:  # what rounds to 1000 of the unit below
            scaled = number / limit
            return f"{scaled:.3g}{suffix}" if scaled < 999.5 else f"{scaled:.0f}{suffix}"
    return f"{number:.0f}"


@dataclasses.dataclass(frozen=True)
class Line:
    """A progress line: its fields in the order they are read, each with its rank (0 the most
    important). The whole line goes to a log file or a Slurm log; on a terminal, `fit` keeps the
    most important fields that fit its width, in the same order."""
    fields: Tuple[Tuple[int, str], ...]

    def __str__(self) -> str:
        return " | ".join(text for _, text in self.fields)

    def fit(self, width: int) -> str:
        kept = list(self.fields)
        while len(kept) > 1 and len(" | ".join(text for _, text in kept)) > width:
            kept.remove(max(kept, key=lambda field: field[0]))  # the least important goes
        return " | ".join(text for _, text in kept)


def line(step: int, steps: Optional[int], values: dict) -> Line:
    """The progress line of Monitor.train's logged `values` at `step` of `steps` (the run's
    --steps), its fields between ` | ` as Megatron's and the step right-aligned to the width of
    --steps, so that lines stack. Tokens are real tokens (padding not counted). Skipped:
    DeepSpeed's count of the steps it did not apply (with fp16 the loss scaler's overflows
    too), the ones that count towards --max-nonfinite-steps in brackets where fewer. On a
    terminal too narrow for all of it, the fields go from the end of IMPORTANCE first."""
    width = len(str(steps or step))
    ms = 1000 * values["throughput/seconds_per_step"]
    skipped, nonfinite = values["train/skipped_steps"], values["train/nonfinite_steps"]
    fields = {
        "step": f"step {step:>{width}}" + (f"/{steps}" if steps else ""),
        "loss": f"loss {values['train/loss']:.4f}",
        "lr": f"lr {values['train/lr']:.3e}",
        "grad norm": (f"grad norm {values['train/grad_norm']:.3f}"
                      if "train/grad_norm" in values else None),
        "loss scale": (f"loss scale {values['train/loss_scale']:g}"
                       if "train/loss_scale" in values else None),
        "ms/step": f"{ms:.0f} ms/step" if ms >= 10 else f"{ms:.1f} ms/step",
        "tokens/s": f"{count(values['throughput/tokens_per_s'])} tokens/s",
        "tokens/s/GPU": f"{count(values['throughput/tokens_per_s_per_gpu'])} tokens/s/GPU",
        "samples/s": f"{values['throughput/samples_per_s']:.1f} samples/s",
        "TFLOPS": (f"{values['throughput/tflops_per_rank']:.1f} TFLOPS/GPU"
                   if "memory/max_allocated_gib" in values else None),
        "MFU": (f"MFU {values['throughput/mfu_percent']:.1f}%"
                if "throughput/mfu_percent" in values else None),
        "memory": (f"memory {values['memory/max_allocated_gib']:.2f} GiB "
                   f"({values['memory/max_reserved_gib']:.2f} reserved)"
                   if "memory/max_allocated_gib" in values else None),
        "tokens seen": f"{count(values['train/tokens_seen'])} tokens seen",
        "elapsed": f"elapsed {clock(values['time/elapsed_seconds'])}",
        "ETA": f"ETA {clock(values['time/eta_seconds'])}" if "time/eta_seconds" in values else None,
        "skipped": f"skipped {skipped}" + (f" ({nonfinite} not finite)" if nonfinite < skipped
                                           else ""),
    }
    importance = IMPORTANCE if skipped == 0 else ("step", "skipped", *IMPORTANCE[1:])
    return Line(tuple((importance.index(name), text) for name, text in fields.items()
                      if text is not None))


# The progress line's fields, the most important first: what a narrow terminal keeps (skipped
# steps come after the step where there are any).
IMPORTANCE = ("step", "loss", "ETA", "tokens/s", "ms/step", "lr", "tokens seen", "MFU",
              "grad norm", "memory", "loss scale", "elapsed", "samples/s", "tokens/s/GPU",
              "TFLOPS", "skipped")


def summary(step: int, steps: int, first_step: int, final: tuple, best: tuple,
            wall_seconds: float, training_seconds: float, out: str,
            checkpoint: Optional[str]) -> str:
    """The lines rank 0 says when a start ends at `step` of `steps`, having resumed after
    `first_step` - 1 (or started): `final` is its last validation's (step, valid loss) (a
    stop signal may come after it), `best` the run's lowest,
    `training_seconds` its training time as its last log line has it, `checkpoint` the newest
    one's tag (None: none written)."""
    trained = f"steps {first_step}-{step}" if step >= first_step else "no step"
    newest = os.path.join(out, "checkpoints", checkpoint) if checkpoint else "none written"
    return "\n".join([
        f"final valid loss {final[1]:.4f} at step {final[0]}",
        f"this start trained {trained} of {steps} in {clock(wall_seconds)} (wall time since "
        f"its process started); the run's training time {clock(training_seconds)}",
        f"best valid loss {best[1]:.4f} at step {best[0]}",
        f"newest checkpoint {newest}",
        f"log {os.path.join(out, 'train_log.jsonl')}",
        f"tensorboard --logdir {os.path.join(out, 'tensorboard')}"])


def processes(count: int) -> str:
    return "1 process" if count == 1 else f"{count} processes"


def start_line(run, step: int, plan, branched: bool, launcher: str, train) -> str:
    """The line that says what a start trains as its steps begin: from where (resumed at `step`
    of `plan`'s checkpoint, branched, or from step 0), the models, the processes, the batch,
    the samples, the loss, the masking, the learning rate, and the training stream `train`."""
    start = ("resumed at" if plan else f"branched from {run.init_plan.step_dir} at" if branched
             else "starting")
    started_by = ("1 process, no launcher" if launcher == "single process" else
                  f"{processes(run.world_size)} from {launcher}")
    return (f"{start} step {step} of {run.steps}: {run.objective} "
            f"{run.model} {run.models[0].pos_encoding}, {started_by} "
            f"({run.layout}), {run.batch_split}, samples of {run.seq_len} tokens, loss normalised "
            f"{run.loss_normalization}, {run.masking}, learning rate "
            f"{schedule_text(run.ds_config)}, {train.description(run.sources)}")
