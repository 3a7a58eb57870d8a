"""What a fine-tune shows and keeps while it trains, on rank 0: within each epoch a tqdm bar on a
terminal, or a plain line at each log point elsewhere (a Slurm log, tupe-compare's log), with the
running loss and learning rate; a line per epoch with the dev-set metrics; the same numbers in
TensorBoard (OUT/tensorboard/TASK/lr=LR,seed=SEED, one run per trial) and in OUT/TASK.log.jsonl.

Log points are 20 per epoch (every 5% of its steps, the last step included), counted in steps, not
seconds: every rank reaches them at the same step, so the running loss is summed over the ranks
(one small all-reduce per point), and a trial done again logs at the same steps. Twenty lines per
epoch keep a Slurm log readable (MNLI's 12,000-step epochs at batch 32: a line every ~600 steps)
and still show a small task's epoch (RTE's 78 steps: every 4).

A trial is all or nothing (progress.Progress keeps finished trials only): the same command again
does a killed trial from its start. So the log and TensorBoard hold the finished trials Progress
keeps, and the one being done: at the start, `keep_only` moves the other trials' log entries to
OUT/TASK.log.redone.jsonl and removes their TensorBoard runs.
"""

import json
import logging
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from tupe_ds.finetune.progress import Progress
from tupe_ds.train.progress import clock
from tupe_ds.tools.files import regular_file, write_atomically

logger = logging.getLogger(__name__)

LOG_POINTS_PER_EPOCH = 20
# A trial's bar on a terminal: the trial and epoch, how far, then the fields that matter most
# first (tqdm cuts a line that does not fit from its end): the loss, the rate, the grid's ETA
BAR = "{{desc}} {{percentage:3.0f}}%|{{bar}}| {fields}"


TRIAL_RUN = re.compile(r"lr=[^,/]+,seed=-?\d+")  # a trial's TensorBoard run: tensorboard_dir


def log_path(out: str, task: str) -> str:
    return os.path.join(out, f"{task}.log.jsonl")


def tensorboard_dir(out: str, task: str, key: str) -> str:
    """OUT/tensorboard/TASK/lr=LR,seed=SEED of the trial whose Progress.key is `key`."""
    return os.path.join(out, "tensorboard", task, key.replace(" ", ","))


def keep_only(out: str, task: str, kept) -> None:
    """The task's log and TensorBoard runs hold the trials in `kept` (Progress keys) alone: the
    other trials' entries, and lines that are no entry (a write cut short by a kill), move byte
    for byte to OUT/TASK.log.redone.jsonl; the other trials' TensorBoard runs move to
    OUT/tensorboard/TASK.redone/ (nothing is deleted; what is not a trial's run, a link or a file
    of the user's, is left where it is). NotRegularFile when the log is no regular file."""
    path = log_path(out, task)
    data = b""
    if os.path.lexists(path):
        regular_file(path, out)  # a FIFO would hang the start, a link write elsewhere
        with open(path, "rb") as f:
            data = f.read()
    stay, leave = [], []
    for line in data.split(b"\n")[:-1]:  # a last piece without its newline: cut short, below
        (stay if trial_of(line) in kept else leave).append(line + b"\n")
    if not data.endswith(b"\n") and data:
        leave.append(data.rsplit(b"\n", 1)[-1] + b"\n")
    if leave:
        with open(path[:-len(".jsonl")] + ".redone.jsonl", "ab") as f:
            f.write(b"".join(leave))
        write_atomically(path, b"".join(stay))
    runs = os.path.join(out, "tensorboard", task)
    kept_runs = {os.path.basename(tensorboard_dir(out, task, key)) for key in kept}
    for name in os.listdir(runs) if os.path.isdir(runs) else []:
        run = os.path.join(runs, name)
        if (name in kept_runs or not TRIAL_RUN.fullmatch(name) or os.path.islink(run)
                or not os.path.isdir(run)):
            continue
        redone = os.path.join(out, "tensorboard", f"{task}.redone")
        os.makedirs(redone, exist_ok=True)
        attempt = len([n for n in os.listdir(redone) if n.startswith(name + ".")]) + 1
        os.rename(run, os.path.join(redone, f"{name}.{attempt}"))


def trial_of(line: bytes):
    """The Progress key of a log entry; None for a line that is not one."""
    try:
        entry = json.loads(line.decode("utf-8"))
        return Progress.key(entry["lr"], entry["seed"])
    except (ValueError, TypeError, KeyError):  # UnicodeDecodeError is a ValueError
        return None


class TrialMonitor:
    """One trial's (learning rate, seed) progress. Every rank calls `start_epoch`, `trained`
    after each optimizer step and `evaluated` after each epoch (the log points sum the ranks'
    losses); rank 0 (`writer`) shows and keeps them."""

    def __init__(self, out: str, task, lr: float, seed: int, epochs: int, steps_per_epoch: int,
                 device, writer: bool, grid: tuple = (1, 1, 0)):
        """`grid`: (this trial's number, the grid's trials, the trials after it still to do)."""
        self.task, self.epochs, self.steps_per_epoch = task, epochs, steps_per_epoch
        self.number, self.trials, self.after = grid
        self.name = f"{task.name} lr {lr:g} seed {seed}"
        self.trial = {"lr": lr, "seed": seed}
        self.interval = max(1, math.ceil(steps_per_epoch / LOG_POINTS_PER_EPOCH))
        self.device, self.writer = device, writer
        self.stream = sys.stdout
        self.log = log_path(out, task.name)
        self.tensorboard = (SummaryWriter(tensorboard_dir(out, task.name, Progress.key(lr, seed)))
                            if writer else None)
        self.step = 0
        self.bar = None
        self.trial_started = time.perf_counter()

    def start_epoch(self, epoch: int) -> None:
        if epoch == 1:  # the grid's ETA: at the trial's own pace since here
            self.trial_started = time.perf_counter()
        self.epoch, self.epoch_step = epoch, 0
        self.since_point = [0.0, 0]  # this rank's loss x examples, examples since the last point
        self.epoch_loss = [0.0, 0]  # every rank's, over the epoch's log points
        self.point_time, self.point_step = time.perf_counter(), self.step
        if self.writer and self.stream.isatty():  # at 80 columns the loss shows: BAR's fields
            self.bar = tqdm(total=self.steps_per_epoch, leave=False, file=self.stream,
                            dynamic_ncols=True, bar_format=BAR.format(fields=""),
                            desc=f"{self.task.name} trial {self.number}/{self.trials} epoch "
                                 f"{epoch}/{self.epochs}")

    def trained(self, loss: float, examples: int, lr: float) -> None:
        """One optimizer step: its mean `loss` over this rank's `examples`, the `lr` it took."""
        self.step, self.epoch_step = self.step + 1, self.epoch_step + 1
        self.since_point = [self.since_point[0] + loss * examples, self.since_point[1] + examples]
        if self.bar is not None:
            self.bar.update(1)
        if self.epoch_step % self.interval and self.epoch_step < self.steps_per_epoch:
            return
        total, count = self.since_point
        if dist.is_initialized():
            summed = torch.tensor([total, count], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed)
            total, count = summed.tolist()
        self.since_point = [0.0, 0]
        self.epoch_loss = [self.epoch_loss[0] + total, self.epoch_loss[1] + count]
        if not self.writer:
            return
        running = total / max(count, 1)
        self.write({"train/loss": running, "train/lr": lr})
        now = time.perf_counter()
        rate = (self.step - self.point_step) / max(now - self.point_time, 1e-9)
        self.point_time, self.point_step = now, self.step
        steps = self.epochs * self.steps_per_epoch  # at the trial's pace so far, not the point's
        pace = self.step / max(now - self.trial_started, 1e-9)
        grid_left = clock((steps - self.step + self.after * steps) / pace)
        if self.bar is not None:
            self.bar.bar_format = BAR.format(fields=f"loss {running:.4f} | lr {lr:.3g} | "
                                                    f"grid ETA {grid_left}")
            self.bar.refresh()
        elif self.epoch_step < self.steps_per_epoch:  # the epoch's line says the rest
            left = tqdm.format_interval((self.steps_per_epoch - self.epoch_step) / rate)
            logger.info(f"{self.name} step {self.step}/{steps} in epoch {self.epoch} "
                        f"({self.epoch_step / self.steps_per_epoch:.0%}): loss {running:.4f}, "
                        f"learning rate now {lr:.3g}, {rate:.2f} steps/s, {left} to the epoch's "
                        f"end; trial {self.number} of {self.trials}, {grid_left} to the grid's "
                        "end")

    def evaluated(self, results: dict) -> None:
        """The epoch's dev-set metrics ({set: {metric: value}}) and its training loss."""
        if not self.writer:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        loss = self.epoch_loss[0] / max(self.epoch_loss[1], 1)
        self.write({"train/epoch_loss": loss,
                    **{f"valid/{name}/{metric}": values[metric]
                       for name, values in results.items() for metric in self.task.metrics}})
        scores = " ".join(f"{name} {metric} {values[metric]:.4f}"
                          for name, values in results.items() for metric in self.task.metrics)
        logger.info(f"{self.name} epoch {self.epoch}/{self.epochs} train loss {loss:.4f} {scores}")

    def write(self, values: dict) -> None:
        """To TensorBoard and one line of OUT/TASK.log.jsonl, written by one append."""
        for tag, value in values.items():
            self.tensorboard.add_scalar(tag, value, self.step)
        entry = {**self.trial, "epoch": self.epoch, "step": self.step, **values}
        with open(self.log, "ab") as f:
            f.write((json.dumps(entry) + "\n").encode())

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
