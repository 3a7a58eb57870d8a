"""The chaos test's report: what each attempt and the end of a schedule are checked for, and
the Report they fill, the end compared with the uninterrupted run's.

Checks is mixed into Chaos (bench/chaos_harness.py): it judges each fault right after its
attempt, keeps account of the complete checkpoints lost, and at the end checks that every fault
was reported and compares the run with the uninterrupted one (compare_runs). bench/chaos_table.py
counts a Report's faults by kind.
"""

import glob
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench import chaos_table
from bench.chaos_faults import NAN_STEP, STOPPING_FAULTS, Fault
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import manifest, safe_load


@dataclass
class Outcome:
    returncode: int
    output: str
    seconds: float


@dataclass
class Report:
    seed: int
    attempts: int = 0
    faults: List[Fault] = field(default_factory=list)
    seconds: float = 0.0
    split_changed: bool = False
    finished: bool = False  # the run reached its last step
    identical: bool = False  # its end equals the uninterrupted run's bit for bit
    lost: dict = field(default_factory=dict)  # attempt -> the checkpoints lost in it
    problems: List[str] = field(default_factory=list)
    differences: dict = field(default_factory=dict)  # the largest, of state and losses

    def summary(self) -> dict:
        return {"seed": self.seed, "attempts": self.attempts,
                "faults": sum(f.triggered for f in self.faults),
                "by_kind": chaos_table.by_kind(self), "split_changed": self.split_changed,
                "seconds": round(self.seconds, 1), "largest_differences": self.differences,
                "problems": self.problems}


class Checks:
    """The checks of a Chaos schedule (bench/chaos_harness.py), mixed into it: on its attempts'
    outputs (`outputs`), its run folder and the complete checkpoints it has seen (`seen`), into
    its `report`."""

    def judge(self, fault: Fault, outcome: Outcome, listed: list) -> bool:
        """Right after its attempt: whether a fault in the attempt fired (the worker said so),
        what a kill's next attempt must say (the take-over of the killed process's lock), what
        a fault must have left untouched; True when it stopped the attempt as it should."""
        if fault.text is None:
            return False
        fault.triggered = fault.triggered and f"fault fired: {fault.text}" in outcome.output
        problems = self.report.problems
        where = f"{fault.kind} ({fault.detail}, attempt {fault.attempt})"
        if fault.kind.startswith("kill"):
            fault.triggered &= outcome.returncode == -9
            if fault.triggered and fault.expect is None:
                pid = self.holder_pid()
                fault.expect = (f"took over {re.escape(self.lock_path)} from process {pid} "
                                if pid else None)
                if not pid:
                    problems.append(f"{where}: the killed run left no lock naming its process")
        elif fault.kind == "eio-long" and fault.triggered and self.listing() != listed:
            problems.append(f"{where}: the checkpoints folder changed in an attempt that could "
                            f"not read it:\n{listed}\nthen\n{self.listing()}")
        elif fault.kind == "eio-short" and "could not read" in outcome.output:
            problems.append(f"{where}: a read error shorter than the retry window stopped the "
                            "run")
        elif fault.kind == "taken-over" and fault.triggered:
            problems.extend(f"{where}: {line}" for line in self.written_after(fault.step))
            if os.path.exists(self.lock_path):
                os.remove(self.lock_path)  # its holder is gone
        return fault.triggered and fault.kind in STOPPING_FAULTS

    def written_after(self, step: int) -> List[str]:
        """What a run taken over in `step` wrote after: run.lock changed from the taker's
        record, log entries or step folders of `step` and after."""
        lines = []
        if self.holder_pid() != self.taker["pid"]:
            lines.append("run.lock no longer names the job that took the folder over")
        logged = [e["step"] for e in (read_log(self.out) if os.path.exists(
            os.path.join(self.out, "train_log.jsonl")) else []) if e.get("step", 0) >= step]
        if logged:
            lines.append(f"train_log.jsonl has entries of steps {logged}")
        saved = [s for s in folders.step_folders(self.checkpoints) if s >= step]
        if saved:
            lines.append(", ".join(map(folders.tag_of, saved)) + " written")
        return lines

    def note_lost(self, number: int) -> None:
        """After each attempt: a checkpoint seen complete that is gone from checkpoints/ and
        set-aside/ was retired, which leaves --keep-checkpoints newer complete checkpoints
        among the live step folders; else it was lost, in this attempt. Newer folders set aside
        or converted (universal/) do not count: a loss would hide behind them."""
        present = set()
        for step_dir in [os.path.join(self.checkpoints, folders.tag_of(s))
                         for s in folders.step_folders(self.checkpoints)] + glob.glob(
                os.path.join(self.checkpoints, folders.SET_ASIDE, "*", "step*")):
            try:
                present.add(manifest.digest(step_dir))
            except OSError:
                pass
        live = folders.complete_steps(self.checkpoints)
        for digest, step in list(self.seen.items()):
            if digest in present:
                continue
            del self.seen[digest]
            newer = sum(s > step for s in live)
            if newer < self.keep:
                self.report.lost.setdefault(number, []).append(
                    f"step{step} (manifest {digest[:12]}) was complete and is gone after attempt "
                    f"{number}, with only {newer} newer complete checkpoints in "
                    f"{self.checkpoints}")

    def check(self, reference: str) -> Report:
        problems = self.report.problems
        for fault in self.report.faults:
            where = f"{fault.kind} ({fault.detail}, attempt {fault.attempt})"
            if not fault.triggered:
                problems.append(f"{where} did not fire")
            elif fault.expect:
                fault.reported = re.search(fault.expect, self.output_showing(fault)) is not None
                if not fault.reported:
                    problems.append(f"{where} not reported: no line of attempt "
                                    f"{fault.shows_in or fault.attempt} matches {fault.expect!r}")
        if f"step {NAN_STEP}: loss or gradient not finite" not in "\n".join(self.outputs):
            problems.append(f"the NaN at step {NAN_STEP} was never reported")
        bit_for_bit = not self.report.split_changed
        differences = compare_runs(self.out, reference, self.steps,
                                   None if bit_for_bit else self.tolerance,
                                   self.report.differences, random_state=bit_for_bit)
        self.report.identical = bit_for_bit and not differences
        problems.extend(differences)
        problems.extend(line for lines in self.report.lost.values() for line in lines)
        if os.path.exists(self.canary):
            problems.append("a planted pickle's code ran")
        return self.report

    def output_showing(self, fault: Fault) -> str:
        """The output of the attempt where the fault's reaction shows (with its second job's),
        and of the next ones while they stopped on a read error, before they saw the folder."""
        texts, number = [], fault.shows_in or fault.attempt
        while number <= len(self.outputs):
            texts.append(self.outputs[number - 1])
            second = os.path.join(self.root, f"attempt{number:03d}-second.log")
            if os.path.exists(second):
                with open(second, errors="replace") as f:
                    texts.append(f.read())
            if number not in self.read_stopped:
                break
            number += 1
        return "\n".join(texts)


def final_files(run: str, steps: int, random_state: bool) -> dict:
    """The final checkpoint's states, with each rank's random generators (`random_state`)."""
    step_dir = os.path.join(run, "checkpoints", f"step{steps}")
    patterns = ["*_states.pt"] + (["rng_rank*.pt"] if random_state else [])
    return {os.path.basename(p): safe_load.load(p) for pattern in patterns
            for p in sorted(glob.glob(os.path.join(step_dir, pattern)))}


def tensors(value, prefix=""):
    if torch.is_tensor(value):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from tensors(value[key], f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensors(item, f"{prefix}[{index}]")


def compare_runs(run: str, reference: str, steps: int, tolerance: Optional[float],
                 measured: dict, weights_only: bool = False,
                 random_state: bool = False) -> List[str]:
    """The final checkpoint's weights and optimizer state (`weights_only`: the weights, for runs
    on other layouts), with `random_state` each rank's random generators, and the logged
    losses, against the uninterrupted run's: equal bit for bit (`tolerance` None), else within
    `tolerance` (absolute for tensors, relative for losses). `measured` gets the largest
    differences found."""
    problems = []
    mine, theirs = (final_files(folder, steps, random_state) for folder in (run, reference))
    if weights_only:
        mine, theirs = ({name: files[name] for name in files if name.startswith("mp_rank_")}
                        for files in (mine, theirs))
    if sorted(mine) != sorted(theirs):
        return [f"final checkpoint files {sorted(mine)}, the uninterrupted run's {sorted(theirs)}"]
    largest = 0.0
    for name in theirs:
        for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "step",
                    "consumed"):
            if key in theirs[name] and mine[name].get(key) != theirs[name][key]:
                problems.append(f"{name}: {key} {mine[name].get(key)!r}, the uninterrupted "
                                f"run's {theirs[name][key]!r}")
        ours = dict(tensors(mine[name]))
        for key, tensor in tensors(theirs[name]):
            other = ours.get(key)
            if other is None or other.shape != tensor.shape:
                problems.append(f"{name}{key}: missing or of another shape")
                continue
            difference = (other.double() - tensor.double()).abs().max().item() \
                if tensor.numel() else 0.0
            largest = max(largest, difference)
            if not (torch.equal(other, tensor) if tolerance is None else
                    difference <= tolerance):
                problems.append(f"{name}{key} differs from the uninterrupted run's by "
                                f"{difference:.2e}")
    measured["state"] = largest
    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # each attempt's purge, said
    tensorboard = EventAccumulator(os.path.join(run, "tensorboard", "tupe"))
    tensorboard.Reload()
    steps_shown = [event.step for event in tensorboard.Scalars("train/loss")]
    if sorted(steps_shown) != list(range(1, steps + 1)):
        problems.append(f"TensorBoard shows train/loss at steps {sorted(steps_shown)}")
    entries = read_log(run)
    counts = {}
    for entry in entries:
        if "train/loss" in entry:
            counts[entry["step"]] = counts.get(entry["step"], 0) + 1
    if counts != {step: 1 for step in range(1, steps + 1)}:
        twice = sorted(s for s, c in counts.items() if c > 1)
        missing = sorted(set(range(1, steps + 1)) - set(counts))
        problems.append(f"train_log.jsonl: steps logged twice {twice}, missing {missing}")
    ours = {e["step"]: e["train/loss"] for e in entries if "train/loss" in e}
    measured["loss"] = 0.0
    for entry in read_log(reference):
        if "train/loss" in entry:
            loss, step = entry["train/loss"], entry["step"]
            if step not in ours or math.isnan(loss) != math.isnan(ours[step]):
                problems.append(f"the loss of step {step}: {ours.get(step)} here, {loss} "
                                "uninterrupted")
                continue
            if math.isnan(loss):  # the NaN step, in both runs
                continue
            relative = abs(ours[step] - loss) / max(1.0, abs(loss))
            measured["loss"] = max(measured["loss"], relative)
            if (ours[step] != loss) if tolerance is None else relative > tolerance:
                problems.append(f"the loss of step {step}: {ours[step]} here, {loss} "
                                "uninterrupted")
    return problems


def read_log(run: str) -> list:
    with open(os.path.join(run, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]
