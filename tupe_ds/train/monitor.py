"""What a run reports: log lines, and on rank 0 a TensorBoard writer beside DeepSpeed's monitor."""

import contextlib
import json
import logging
import math
import os
import statistics
import threading
import time
from typing import Optional

import psutil
import torch
from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
from torch.utils.tensorboard import SummaryWriter

from tupe_ds.model.config import ModelConfig
from tupe_ds.tools.errors import FolderTakenOver, NotRegularFile, TrainingStopped
from tupe_ds.tools.files import regular_file, write_atomically
from tupe_ds.train import progress
from tupe_ds.train.checkpoint import reads
from tupe_ds.train.run_folder import files as folder_files

logger = logging.getLogger(__name__)


def flops_per_step(config: ModelConfig, global_batch: int, seq_len: int) -> float:
    """Megatron's training FLOPs per iteration: 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, l, h, v = global_batch, seq_len, config.num_layers, config.hidden_size, config.vocab_size
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def run_flops_per_step(configs: tuple, global_batch: int, seq_len: int) -> float:
    """All the run's networks (ELECTRA: generator and discriminator)."""
    return sum(flops_per_step(c, global_batch, seq_len) for c in configs)


def log_there(path: str) -> bool:
    """Whether the log `path` of a run folder (OUT/train_log.jsonl) is there, checked before
    rank 0 reads, appends to or replaces it: a regular file inside its folder (a FIFO would hang
    the run, a link out would have it read and write elsewhere, a link to nothing would have the
    append create its target), the check retried (reads.Unreadable after the window). Else
    TrainingStopped naming it, with nothing written to it: rank 0 alone keeps the log, so it
    stops alone (exit code 3, the others ended by the launcher)."""
    try:
        reads.retried(path, lambda: regular_file(path, os.path.dirname(path)))
    except FileNotFoundError:
        if os.path.islink(path):
            raise TrainingStopped(f"the run's log {path}: a symbolic link to nothing (to "
                                  f"{os.readlink(path)}); remove it", everywhere=False) from None
        return False
    except NotRegularFile as error:
        raise TrainingStopped(f"the run's log {error}", everywhere=False) from None
    return True


def read_log(path: str) -> bytes:
    """The bytes of the log `path` (b"" when it is not there yet), checked as `log_there` says
    and retried."""
    return reads.read_bytes(path, os.path.dirname(path)) if log_there(path) else b""


def appended(path: str, text: bytes) -> None:
    """`text` at the end of the log `path` (created when it is not there), checked first as
    `log_there` says."""
    log_there(path)
    with open(path, "ab") as f:
        f.write(text)


def keep_log_until(path: str, step: int) -> int:
    """A run resumed at `step` (0: started anew) trains the steps after it again: their entries
    in train_log.jsonl, written before a kill or a fallback, move to train_log.redone.jsonl, so
    that the log holds each step once. Returns how many moved. A line that is not a log entry
    (a write cut short by a kill) moves too; lines are moved byte for byte."""
    data = read_log(path)
    lines = [line + b"\n" for line in data.split(b"\n")]
    if data.endswith(b"\n") or not data:
        lines.pop()  # the empty piece after the last newline
    kept, redone = [], []
    for line in lines:
        entry = log_entry(line)
        (kept if entry is not None and entry["step"] <= step else redone).append(line)
    if redone:
        appended(path[:-len(".jsonl")] + ".redone.jsonl", b"".join(redone))
    if redone or not data.endswith(b"\n") and data:  # the next entry starts on a line of its own
        write_atomically(path, b"".join(kept))
    return len(redone)


def log_entry(line: bytes) -> Optional[dict]:
    """A log line's entry; None when it is not one (a JSON object in UTF-8 with an int step, as
    `Monitor.scalars` writes it)."""
    try:
        entry = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return entry if isinstance(entry, dict) and type(entry.get("step")) is int else None


def log_entries(path: str) -> list:
    """The entries of the log `path`, in its order."""
    return [entry for entry in map(log_entry, read_log(path).split(b"\n")) if entry is not None]


def logged_times(path: str, resumed_at: int) -> dict:
    """The last value of each cumulative time/NAME_seconds in a run's log (NAME in
    Monitor.TIMED), and the largest time/elapsed_seconds ("elapsed"). A log of an earlier
    tupe_ds has none: its training seconds are estimated (`estimated_training_seconds`) for the
    `resumed_at` steps it trained."""
    found, step_times = {}, {}
    for entry in log_entries(path):
        found.update({name: entry[f"time/{name}_seconds"] for name in Monitor.TIMED
                      if isinstance(entry.get(f"time/{name}_seconds"), float)})
        if "throughput/seconds_per_step" in entry:
            step_times[entry["step"]] = entry["throughput/seconds_per_step"]
        if isinstance(entry.get("time/elapsed_seconds"), float):
            found["elapsed"] = max(found.get("elapsed", 0.0), entry["time/elapsed_seconds"])
    if "training" not in found and step_times:
        found["training"] = estimated_training_seconds(step_times, resumed_at)
    return found


def validations(path: str) -> list:
    """The (step, valid/loss) pairs of the log `path`, in its order."""
    return [(entry["step"], entry["valid/loss"]) for entry in log_entries(path)
            if isinstance(entry.get("valid/loss"), float)]


def best_validation(path: str, final: tuple) -> tuple:
    """The (step, valid/loss) lowest in the log `path`, or `final` (the same pair, measured at
    the end of a start and not logged where no validation fell on its last step); the earliest
    of equal ones; a nan (a diverged validation) only where every one is."""
    return min([final, *validations(path)],
               key=lambda pair: (math.isnan(pair[1]), 0.0 if math.isnan(pair[1]) else pair[1],
                                 pair[0]))


def finished_summary(out: str, step: int, checkpoint: str) -> Optional[str]:
    """The summary of a run whose newest checkpoint, `checkpoint`, is its last `step`, from its
    log alone: nothing built, nothing evaluated. None where the log has no validation at that
    step (then the run evaluates as any start does)."""
    path = os.path.join(out, "train_log.jsonl")
    final = [pair for pair in validations(path) if pair[0] == step]
    if not final:
        return None
    return progress.summary(step, step, step + 1, final[-1], best_validation(path, final[-1]),
                            time.time() - psutil.Process().create_time(),
                            logged_times(path, step).get("training", 0.0), out, checkpoint)


def estimated_training_seconds(step_times: dict, steps: int) -> float:
    """The training seconds of `steps` steps from an earlier tupe_ds's log ({step:
    seconds_per_step}), which has no time/training_seconds: `steps` times the median of its
    seconds per step. The median, because its first line after each start divided that start's
    whole start-up by one step."""
    return steps * statistics.median(step_times.values())


class Monitor:
    """Progress lines (progress.py), scalars, and where the run's time goes: cumulative seconds
    of training steps (`time/training_seconds`, what Figure 5's time axis and "time to the
    baseline's loss" use), of evaluation (with the positional images) and of checkpoint saves,
    carried over resumes in the checkpoints (`times`), and each start's seconds before its first
    step (`time/startup_seconds`, on its first log line). With `lock` (rank 0's OUT/run.lock),
    each write checks first that the run still holds its folder (RunLock.stop_unless_held): a
    run another job took over writes no log line or TensorBoard event after the new holder
    trimmed the log to its own resume step."""

    TIMED = ("training", "evaluation", "checkpoint")

    def __init__(self, out: str, configs: tuple, seq_len: int, world_size: int, rank: int,
                 resumed_at: int = 0, times: dict = None, settings: dict = None, lock=None,
                 steps: int = None, device: torch.device = None, precision: str = "fp32",
                 tokens_seen: int = 0):
        """`steps`: the run's --steps (the line's step/N and ETA); `device` and `precision`
        (bf16, fp16, fp32): on CUDA the line has the GPU's figures, MFU where progress.py knows
        the device's peak for the precision; `tokens_seen`: the real tokens trained on before
        this start."""
        self.lock = lock
        self.out = out
        self.log_path = os.path.join(out, "train_log.jsonl")  # appended to by resumed runs
        self.writer = None
        self.seconds = {name: float((times or {}).get(name, 0.0)) for name in self.TIMED}
        self.elapsed_before = float((times or {}).get("elapsed", 0.0))  # the earlier starts'
        self.tokens_seen = tokens_seen
        self.loading_seconds = 0.0  # making batches, since the last line
        self.step_rate = None  # the learning rate of the step being trained (`watch`)
        self.failure = None  # what rank 0 could not write or read (run_folder/files.py)
        self.events = os.path.join(out, "tensorboard", "tupe")
        if rank == 0:
            quiet_event_writer_errors()
            with self.writing(self.log_path):
                keep_log_until(self.log_path, resumed_at)
                # the save that ended the last start is in the log, not in its own checkpoint
                for name, value in logged_times(self.log_path, resumed_at).items():
                    if name in self.seconds:
                        self.seconds[name] = max(self.seconds[name], value)
                    elif "elapsed" not in (times or {}):  # a checkpoint without it: the log's
                        self.elapsed_before = value
            with self.writing(self.events):
                # TensorBoard hides what earlier attempts wrote for the steps trained again
                self.writer = SummaryWriter(self.events, purge_step=resumed_at + 1)
        self.sample_flops = run_flops_per_step(configs, 1, seq_len)
        self.world_size = world_size
        self.steps, self.first_step = steps, resumed_at + 1
        self.last_step = resumed_at
        self.last_time = self.startup = None
        self.process_started = psutil.Process().create_time()
        self.eta = progress.Eta()
        self.device = device
        self.gpu = device is not None and device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(device) if self.gpu else None
        self.precision = precision
        self.note = ""  # said once, on the first line
        if self.gpu and progress.peak_tflops(self.device_name, precision) is None:
            self.note = progress.no_mfu_note(self.device_name, precision)
        self.paused = 0.0  # seconds of evaluation and saves since last_time
        self.settings = settings or {}  # scalars of the run's settings, on the first log line

    @contextlib.contextmanager
    def writing(self, path: str):
        """A write to `path` (or a read of it) that fails is noted in `failure`, said at the next
        agreement (folder_files.agreed), and nothing more is written: the run stops there."""
        try:
            yield
        except FolderTakenOver:
            raise
        except (OSError, TrainingStopped) as error:
            self.failure = self.failure or folder_files.failed("write", error, path)
            self.writer = None

    def watch(self, deepspeed_monitor) -> None:
        """DeepSpeed's own TensorBoard, CSV and W&B writes (its MonitorMaster, once per step on
        rank 0) check the lock first and fail as this monitor's do: noted, said at the next
        agreement."""
        write_events = deepspeed_monitor.write_events
        events = os.path.join(self.out, "tensorboard")

        def write_events_noting_failure(event_list):
            # its lr is read after the scheduler stepped, the next step's: the step's own, as
            # train/lr has it
            event_list = [(name, self.step_rate, x) if name == "Train/Samples/lr" else
                          (name, value, x) for name, value, x in event_list]
            if self.failure is None:
                with self.writing(events):
                    self.stop_unless_held()
                    write_events(event_list)

        deepspeed_monitor.write_events = write_events_noting_failure

    def start(self) -> None:
        """The first step begins: the clock of the first interval starts here, not at the
        process's start (`time/startup_seconds` has that)."""
        self.last_time = time.perf_counter()
        self.startup = time.time() - self.process_started

    @contextlib.contextmanager
    def timing(self, what: str):
        """Time spent on `what` ("evaluation", "checkpoint"), not on training."""
        started = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            self.seconds[what] += spent
            self.paused += spent

    def saved(self, step: int) -> None:
        """A checkpoint was written: its seconds go in the log (its own state has the times
        from before it)."""
        self.scalars(step, {"time/checkpoint_seconds": self.seconds["checkpoint"]})

    def times(self) -> dict:
        """The cumulative seconds so far, for a checkpoint's state: a resumed run goes on from
        them (`elapsed`: the run's wall time, its starts' summed)."""
        unlogged = time.perf_counter() - self.last_time - self.paused
        return {**self.seconds, "training": self.seconds["training"] + unlogged,
                "elapsed": self.elapsed()}

    def elapsed(self) -> float:
        """The run's wall time: this process's, after the earlier starts' to the checkpoint
        resumed."""
        return self.elapsed_before + time.time() - self.process_started

    def loading(self, micro_batches):
        """The step's micro-batches, the time spent making each counted as data loading (a
        pipeline stage that reads no data makes none)."""
        batches = iter(micro_batches)
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            self.loading_seconds += time.perf_counter() - started
            if batch is None:
                return
            yield batch

    def scalars(self, step: int, values: dict) -> None:
        """To TensorBoard and to the run's train_log.jsonl (one JSON object per call)."""
        if self.writer is None:
            return
        self.stop_unless_held()
        with self.writing(self.events):
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        with self.writing(self.log_path):
            appended(self.log_path, (json.dumps({"step": step, **values}) + "\n").encode())

    def train(self, step: int, metrics: dict, lr: float, grad_norm, loss_scale,
              nonfinite_steps: int, samples: int, global_batch: int, tokens_seen: int,
              skipped_steps: int = None) -> progress.Line:
        """The progress line (progress.line) and scalars of the steps since the last call (the
        first call: since `start`), which trained `samples`; metrics: name -> value; `lr` and
        `global_batch`: the last step's; `tokens_seen`: the real tokens of the run's samples
        so far; `nonfinite_steps`: the steps not applied so far that count towards
        --max-nonfinite-steps, `skipped_steps` all that DeepSpeed did not apply
        (engine.skipped_steps: with fp16 the loss scaler's overflows too; None: the same)."""
        now = time.perf_counter()
        trained = max(now - self.last_time - self.paused, 1e-9)
        interval_steps = max(step - self.last_step, 1)
        self.seconds["training"] += trained
        self.eta.add(interval_steps, trained, self.paused)
        self.last_time, self.last_step, self.paused = now, step, 0.0
        tokens, self.tokens_seen = tokens_seen - self.tokens_seen, tokens_seen
        loading, self.loading_seconds = self.loading_seconds, 0.0
        values = {f"train/{name}": value for name, value in metrics.items()}
        values.update({
            "train/lr": lr,
            "train/global_batch": global_batch,
            "train/tokens_seen": tokens_seen,
            "throughput/samples_per_s": samples / trained,
            "throughput/tokens_per_s": tokens / trained,
            "throughput/tokens_per_s_per_gpu": tokens / trained / self.world_size,
            "throughput/tflops_per_rank": (self.sample_flops * samples / trained
                                           / self.world_size / 1e12),
            "throughput/seconds_per_step": trained / interval_steps,
            "throughput/data_loading_percent": 100 * min(loading / trained, 1.0),
            "train/nonfinite_steps": nonfinite_steps,
            "train/skipped_steps": nonfinite_steps if skipped_steps is None else skipped_steps,
            "time/elapsed_seconds": self.elapsed(),
            # evaluation's and saves' seconds are logged where they change: one point a step
            "time/training_seconds": self.seconds["training"],
        })
        if self.steps:
            values["time/eta_seconds"] = self.eta.seconds(self.steps - step)
        if self.startup is not None:
            values["time/startup_seconds"] = self.startup
            self.startup = None
        values.update(self.settings)
        self.settings = {}
        if grad_norm is not None:
            values["train/grad_norm"] = float(grad_norm)
        if loss_scale is not None:
            values["train/loss_scale"] = float(loss_scale)
        if self.gpu:
            values.update(progress.cuda_memory(self.device))
            mfu = progress.mfu_percent(values["throughput/tflops_per_rank"], self.device_name,
                                       self.precision)
            if mfu is not None:
                values["throughput/mfu_percent"] = mfu
        self.scalars(step, values)
        if self.note:
            logger.info(self.note)
            self.note = ""
        return progress.line(step, self.steps, values)

    def summary(self, step: int, valid_step: int, valid_loss: float, checkpoint) -> str:
        """What rank 0 says when this start ends at `step`, its last validation at `valid_step`
        with a loss of `valid_loss` (progress.summary), the best of the run read from its log;
        `checkpoint`: the newest one's tag, None for none. "" on the other ranks."""
        if self.writer is None:
            return ""
        best = best_validation(self.log_path, (valid_step, valid_loss))
        return progress.summary(step, self.steps, self.first_step, (valid_step, valid_loss), best,
                                time.time() - self.process_started, self.seconds["training"],
                                self.out, checkpoint)

    def positional_images(self, step: int, tag: str, scores: torch.Tensor) -> None:
        """One grey image per head of the content-free logits [heads, n, n] (paper, Figure 6)."""
        if self.writer is None:
            return
        self.stop_unless_held()
        scores = scores.detach().float().cpu()
        low = scores.amin(dim=(1, 2), keepdim=True)
        high = scores.amax(dim=(1, 2), keepdim=True)
        images = (scores - low) / (high - low).clamp(min=1e-12)
        with self.writing(self.events):
            for head, image in enumerate(images):
                self.writer.add_image(f"{tag}/head{head}", image[None], step)

    def stop_unless_held(self) -> None:
        if self.lock is not None:
            self.lock.stop_unless_held()

    def close(self) -> None:
        if self.writer is not None:
            with self.writing(self.events):
                self.writer.close()


def quiet_event_writer_errors() -> None:
    """TensorBoard writes its events in a thread, which prints the traceback of a failed write
    (a full disk) as it ends; the error is raised again at the run's next write of events,
    where Monitor.writing notes it: no traceback for it."""
    previous = threading.excepthook
    if getattr(previous, "quiet_event_writer", False):  # an earlier start's, in this process
        return

    def hook(args):
        if not (isinstance(args.thread, _AsyncWriterThread)
                and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.quiet_event_writer = True
    threading.excepthook = hook
