"""Chaos: one tiny fp32 training run driven to its end through a seeded random schedule of
faults, then compared with the same run left alone.

The run is tupe-pretrain under torchrun (2 CPU ranks, ZeRO-2, dropout 0), through
tests/support/fault_worker.py, which injects the faults a process can suffer. Each attempt starts the
same command (a resume, after the first); what goes wrong in it, and to the run folder between
attempts, is drawn from the seed:

- in an attempt (tests/support/fault_worker.py): SIGKILL of every rank and the launcher mid-step, after
  a checkpoint file (mid-save), between the manifest and `latest`, after `latest`, during
  retention's deletion; SIGUSR1 to one rank (preemption: save and stop); a full disk (every
  checkpoint file of one save fails with ENOSPC); a second job started on the same folder while
  the first trains; the next attempt on another data-parallel size or micro-batch split;
- between attempts, in the newest complete checkpoint or the run folder: a file truncated, a
  byte flipped, a file deleted, a file added that the manifest does not list, a pickle that
  would run code (listed with a rewritten manifest, unlisted, or under another file's name), a
  damaged manifest.json, layout.json, `latest`, run.json or run.lock, a lock left by a process
  that died;
- in every attempt and in the uninterrupted run alike: NaN in rank 0's loss at NAN_STEP (a step
  the run must skip, on every rank, each time it trains it).

At the end: the weights, the optimizer state and the logged losses equal the uninterrupted
run's (bit for bit when every attempt had the same split, else within 1e-6); train_log.jsonl
holds each step once; every fault the run can see is reported in an attempt's output; nothing
that was complete was lost (every complete checkpoint seen is still in checkpoints/ or
set-aside/, or retention removed it: --keep-checkpoints newer ones are there); no pickle's code
ever ran.

    python bench/chaos.py --attempts 120 --seed 1 --out build/chaos   # a few hundred faults
    (tests/test_chaos.py runs two short schedules of it)
"""

import tupe_ds.tools.third_party_warnings  # noqa: F401  (first: filters import warnings)
import argparse
import glob
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tupe_ds.distributed import launchers  # noqa: E402
from tupe_ds.train import run_lock  # noqa: E402
from tupe_ds.train.checkpoint import folder as folders  # noqa: E402
from tupe_ds.train.checkpoint import manifest, safe_load  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
NAN_STEP = 7
NAN_RANK = 0  # every split has it
REFERENCE_SPLIT = (2, 8)  # processes, micro-batch: global batch 16 = 8 x 1 x dp 2
SPLITS = [(2, 8), (2, 4), (1, 8), (1, 4)]
PROCESS_FAULTS = ["kill-mid-step", "kill-after-file", "kill-after-manifest", "kill-after-latest",
                  "kill-during-deletion", "usr1", "disk-full", "second-job", "another-split"]
FILE_FAULTS = ["truncated", "flipped", "missing", "unlisted", "pickle-listed", "pickle-unlisted",
               "pickle-renamed", "manifest", "layout", "latest", "run.json", "run.lock",
               "dead-holder"]


@dataclass
class Fault:
    kind: str
    attempt: int
    detail: str = ""
    expect: Optional[str] = None  # a text some later output must hold (None: nothing to say)
    triggered: bool = True
    reported: Optional[bool] = None


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
    problems: List[str] = field(default_factory=list)
    differences: dict = field(default_factory=dict)  # the largest, of state and losses

    def summary(self) -> dict:
        kinds = {}
        for fault in self.faults:
            row = kinds.setdefault(fault.kind, {"injected": 0, "triggered": 0, "reported": 0,
                                                "silent by design": 0})
            row["injected"] += 1
            row["triggered"] += fault.triggered
            if fault.triggered and fault.expect is None:
                row["silent by design"] += 1
            row["reported"] += bool(fault.triggered and fault.reported)
        return {"seed": self.seed, "attempts": self.attempts,
                "faults": sum(f.triggered for f in self.faults), "by_kind": kinds,
                "split_changed": self.split_changed, "seconds": round(self.seconds, 1),
                "largest_differences": self.differences,
                "problems": self.problems}


def free_port() -> str:
    return str(launchers.free_port())


def environment(fault: str) -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TUPE_DS_FAULT": fault,
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))}


class Chaos:
    def __init__(self, data: str, root: str, seed: int, steps: int = 16, keep: int = 2,
                 split_changes: bool = True, cover: bool = False, timeout: float = 300,
                 tolerance: float = 1e-6):
        """`cover`: the kinds of faults in a shuffled cycle, each attempt one file fault and one
        process fault, so that a short schedule holds every kind (tests/test_chaos.py); else
        drawn independently (0-2 file faults an attempt)."""
        self.data, self.root, self.steps, self.keep = data, root, steps, keep
        self.random = random.Random(seed)
        self.cover, self.tolerance = cover, tolerance
        self.cycles = {}
        self.split_changes, self.timeout = split_changes, timeout
        self.out = os.path.join(root, "run")
        self.checkpoints = os.path.join(self.out, "checkpoints")
        self.canary = os.path.join(root, "canary-code-ran")
        self.report = Report(seed)
        self.outputs: List[str] = []
        self.seen = {}  # manifest digest -> step of every complete checkpoint seen

    def command(self, split, *extra) -> list:
        processes, micro = split
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(processes), "--master_port", free_port(), WORKER, "pretrain",
                "--data", self.data, "--model", "tiny", "--ds-config", CPU_CONFIG,
                "--seq-len", "64", "--log-interval", "1", "--eval-samples", "32",
                "--steps", str(self.steps), "--save-interval", "2",
                "--eval-interval", str(self.steps), "--dropout", "0", "--lr", "2e-3",
                "--warmup-steps", "2", "--keep-checkpoints", str(self.keep),
                "--micro-batch", str(micro), *extra]

    def launch(self, out: str, split, fault: str, log: str) -> subprocess.Popen:
        nan = f"nan-loss:{NAN_RANK}:{NAN_STEP}"
        with open(log, "w") as f:
            return subprocess.Popen(self.command(split, "--out", out), stdout=f,
                                    stderr=subprocess.STDOUT,
                                    env=environment(";".join(filter(None, [nan, fault]))),
                                    start_new_session=True)

    def finish(self, process: subprocess.Popen, log: str, start: float) -> Outcome:
        try:
            code = process.wait(self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            self.report.problems.append(f"{log}: still running after {self.timeout} s, killed")
        with open(log, errors="replace") as f:
            return Outcome(code, f.read(), time.monotonic() - start)

    def reference(self, out: Optional[str] = None, split=REFERENCE_SPLIT) -> str:
        """The uninterrupted run (with the same NaN step), in `out` (default ROOT/reference):
        run when that folder does not hold it yet."""
        out = out or os.path.join(self.root, "reference")
        if not os.path.exists(os.path.join(out, "checkpoints", f"step{self.steps}")):
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            start = time.monotonic()
            outcome = self.finish(self.launch(out, split, "", out + ".log"), out + ".log", start)
            if outcome.returncode != 0:
                raise RuntimeError(f"the uninterrupted run failed:\n{outcome.output[-4000:]}")
        return out

    # -- the run's position, as the folder shows it

    def complete(self) -> dict:
        return folders.survey(self.checkpoints)[0]

    def position(self) -> int:
        steps = folders.complete_steps(self.checkpoints)
        return steps[-1] if steps else 0

    def remember_complete(self) -> None:
        for step in self.complete():
            step_dir = os.path.join(self.checkpoints, folders.tag_of(step))
            try:
                self.seen[manifest.digest(step_dir)] = step
            except OSError:
                pass

    def draw(self, kinds: list) -> str:
        if not self.cover:
            return self.random.choice(kinds)
        cycle = self.cycles.setdefault(tuple(kinds), [])
        if not cycle:
            cycle.extend(self.random.sample(kinds, len(kinds)))
        return cycle.pop()

    def forget(self, step_dir: str) -> None:
        """A checkpoint whose manifest the schedule itself rewrites is no longer the one seen."""
        self.seen.pop(manifest.digest(step_dir), None)

    # -- faults in an attempt

    def process_fault(self, attempt: int, split) -> tuple:
        """(TUPE_DS_FAULT text, Fault or None, split of the attempt, second job?). An attempt on
        another split than the uninterrupted run's also stops (SIGUSR1) before the last step,
        so that the last checkpoint is written on the uninterrupted run's layout."""
        text, fault, split, second = self.drawn_process_fault(attempt, split)
        if self.position() < self.steps - 1:  # every attempt of the schedule ends early
            stop = min(self.steps - 1, self.position() + 4)
            text = ";".join(filter(None, [text, f"usr1:0:{stop}"]))
        return text, fault, split, second

    def drawn_process_fault(self, attempt: int, split) -> tuple:
        at = self.position()
        if at >= self.steps - 1:
            return "", None, REFERENCE_SPLIT, False
        kind = self.draw(PROCESS_FAULTS if self.split_changes else
                         [k for k in PROCESS_FAULTS if k != "another-split"])
        ahead = self.random.randint(1, min(3, self.steps - 1 - at))
        step = at + ahead
        save_step = min(self.steps - 1, step + step % 2) if (step + step % 2) < self.steps \
            else None
        if kind == "another-split" and self.split_changes:
            split = self.random.choice([s for s in SPLITS if s != split])
            # stopped before the end, so that the last attempt writes the reference's layout
            processes, micro = split
            said = (f"micro-batch {micro} x accumulation {16 // (micro * processes)} x dp "
                    f"{processes}")
            return f"usr1:0:{step}", Fault("another-split", attempt, f"{said} until step {step}",
                                           expect=said), split, False
        if kind == "another-split":
            kind = "kill-mid-step"
        if kind in ("kill-after-file", "kill-after-manifest", "kill-after-latest",
                    "kill-during-deletion", "disk-full") and save_step is None:
            kind = "kill-mid-step"
        if kind == "kill-mid-step":
            return f"kill-mid-step:{step}", Fault(kind, attempt, f"step {step}",
                                                  expect="resumed at step|starting step 0"), \
                split, False
        if kind == "kill-after-file":
            pattern = self.random.choice(["mp_rank_00_model_states.pt", "zero_pp_rank_1_*",
                                          "zero_pp_rank_0_*"])
            if split[0] == 1 and pattern == "zero_pp_rank_1_*":
                pattern = "zero_pp_rank_0_*"
            return f"kill-after-file:{pattern}:{save_step}", Fault(
                kind, attempt, f"{pattern} of step{save_step}",
                expect=f"step{save_step} \\(.*moved to"), split, False
        if kind in ("kill-after-manifest", "kill-after-latest", "kill-during-deletion"):
            return f"{kind}:{save_step}", Fault(kind, attempt, f"save of step{save_step}",
                                                expect="resumed at step"), split, False
        if kind == "usr1":
            rank = self.random.randrange(split[0])
            return f"usr1:{rank}:{step}", Fault(kind, attempt, f"rank {rank} at step {step}",
                                                expect=f"stopping at step {step} on SIGUSR1"), \
                split, False
        if kind == "disk-full":
            return f"disk-full:{save_step}", Fault(
                kind, attempt, f"save of step{save_step}",
                expect=f"could not write checkpoint step{save_step} .*No space left"), split, False
        hold = os.path.join(self.root, f"attempt{attempt:03d}.hold")
        return f"hold:{step}:{hold}", Fault("second-job", attempt, f"while step {step} trains",
                                            expect="this run folder is in use by"), split, True

    # -- faults between attempts

    def file_fault(self, attempt: int, hit: set) -> Optional[Fault]:
        """One fault between attempts; `hit`: what the attempt's faults damaged so far (the
        newest checkpoint, the lock, ...): one fault a target, so that none hides another."""
        kind = self.draw(FILE_FAULTS)
        target = {"dead-holder": "run.lock"}.get(kind, kind) if kind in (
            "run.json", "run.lock", "dead-holder", "latest") else "checkpoint"
        if target in hit:
            return None
        hit.add(target)
        complete = self.complete()
        if target != "checkpoint":
            return self.folder_fault(kind, attempt)
        if not complete:
            return None
        step = max(complete)
        tag = folders.tag_of(step)
        step_dir = os.path.join(self.checkpoints, tag)
        files = sorted(complete[step]["files"])
        name = self.random.choice([n for n in files if n.endswith(".pt")])
        path = os.path.join(step_dir, name)
        fault = Fault(kind, attempt, f"{tag}/{name}")
        if kind == "truncated":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            fault.expect = f"{re.escape(path)}: \\d+ bytes where the manifest says"
        elif kind == "flipped":
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x10]))
            fault.expect = f"{re.escape(path)}: its checksum differs"
        elif kind == "missing":
            os.remove(path)
            fault.expect = f"{re.escape(path)}: missing"
        elif kind == "unlisted":
            extra = os.path.join(step_dir, "notes.txt")
            with open(extra, "w") as f:
                f.write("a file someone left here\n")
            fault.detail = f"{tag}/notes.txt"
            fault.expect = f"{re.escape(extra)}: not listed in its manifest"
        elif kind.startswith("pickle-"):
            self.forget(step_dir)
            fault.expect = self.plant_pickle(kind, step_dir, name)
        elif kind == "manifest":
            self.forget(step_dir)
            with open(os.path.join(step_dir, manifest.MANIFEST), "r+b") as f:
                f.seek(self.random.randrange(max(os.path.getsize(f.name) - 8, 1)))
                f.write(b"\x00garbage")
            fault.detail = f"{tag}/manifest.json"
            fault.expect = f"checkpoint {tag}: .*manifest.json: not"
        elif kind == "layout":
            with open(os.path.join(step_dir, "layout.json"), "w") as f:
                f.write("{not json")
            layout_path = os.path.join(step_dir, "layout.json")
            fault.detail = f"{tag}/layout.json"
            fault.expect = f"{re.escape(layout_path)}: (\\d+ bytes where|its checksum differs)"
        return fault

    def plant_pickle(self, kind: str, step_dir: str, name: str) -> str:
        """A pickle that would create the canary file if unpickled: in place of `name` with the
        manifest rewritten to match (as a sender would), beside it unlisted, or listed under a
        name of its own."""
        canary = self.canary

        class Payload:
            def __reduce__(self):
                return os.system, (f"touch {canary}",)

        target = {"pickle-listed": name, "pickle-unlisted": "bf16_" + name,
                  "pickle-renamed": "zero_pp_rank_7_mp_rank_00_optim_states.pt"}[kind]
        path = os.path.join(step_dir, target)
        torch.save({"optimizer_state_dict": Payload()}, path)
        if kind != "pickle-unlisted":
            record = json.load(open(os.path.join(step_dir, manifest.MANIFEST)))
            record["files"].update(manifest.describe(step_dir, [target]))
            manifest.write(step_dir, record)
            return f"{re.escape(path)}: holds more than tensors"
        return f"{re.escape(path)}: not listed in its manifest"

    def folder_fault(self, kind: str, attempt: int) -> Fault:
        if kind == "latest":
            if os.path.isdir(self.checkpoints):
                with open(os.path.join(self.checkpoints, "latest"), "wb") as f:
                    f.write(os.urandom(12))
            return Fault(kind, attempt, "checkpoints/latest (informative only)")
        if kind == "run.json":
            path = os.path.join(self.out, "run.json")
            if os.path.exists(path):
                with open(path, "w") as f:
                    f.write('{"objective": ')
                return Fault(kind, attempt, "run.json", expect="run.json: not readable")
            return Fault(kind, attempt, "run.json (none yet)", triggered=False)
        path = os.path.join(self.out, "run.lock")
        os.makedirs(self.out, exist_ok=True)
        if kind == "run.lock":
            with open(path, "wb") as f:
                f.write(b"\x00\x01 not a lock")
            return Fault(kind, attempt, "run.lock", expect="took over .*run.lock .*damaged")
        gone = subprocess.Popen(["true"])
        gone.wait()
        with open(path, "w") as f:
            json.dump({**run_lock.this_holder(), "pid": gone.pid, "pid_start": 1,
                       "started": "earlier"}, f)
        return Fault(kind, attempt, f"run.lock of process {gone.pid}, ended",
                     expect=f"took over .*run.lock from process {gone.pid} .*ended")

    # -- one attempt

    def attempt(self, number: int, split, fault_text: str, second_job: bool) -> Outcome:
        log = os.path.join(self.root, f"attempt{number:03d}.log")
        for _ in range(3):
            start = time.monotonic()
            process = self.launch(self.out, split, fault_text, log)
            if second_job:
                self.second_job(number, process, log)
            outcome = self.finish(process, log, start)
            if not port_taken(outcome):
                return outcome
        return outcome

    def second_job(self, number: int, first: subprocess.Popen, log: str) -> None:
        """While the first trains (held in a step by its `hold` fault), the same command again
        on the same folder: refused."""
        hold = os.path.join(self.root, f"attempt{number:03d}.hold")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and first.poll() is None and \
                not os.path.exists(hold + ".waiting"):
            time.sleep(0.2)
        if first.poll() is not None or not os.path.exists(hold + ".waiting"):
            self.report.faults[-1].triggered = False
            open(hold, "w").close()
            return
        second_log = os.path.join(self.root, f"attempt{number:03d}-second.log")
        for _ in range(3):
            outcome = self.finish(self.launch(self.out, (1, 8), "", second_log), second_log,
                                  time.monotonic())
            if not port_taken(outcome):
                break
        open(hold, "w").close()  # the first goes on
        if outcome.returncode == 0:
            self.report.problems.append(f"attempt {number}: a second job on the same folder "
                                        "was not refused")

    def run(self, attempts: int) -> Report:
        start = time.monotonic()
        split, number = REFERENCE_SPLIT, 0
        while True:
            number += 1
            fault_attempt = number <= attempts
            if fault_attempt:
                files = (number > 1) if self.cover else self.random.choice([0, 0, 1, 1, 2])
                hit = set()
                for _ in range(files):
                    fault = self.file_fault(number, hit)
                    if fault:
                        self.report.faults.append(fault)
                text, fault, split, second = self.process_fault(number, split)
                if fault:
                    self.report.faults.append(fault)
            else:
                text, fault, split, second = "", None, REFERENCE_SPLIT, False
            self.report.split_changed |= split != REFERENCE_SPLIT
            outcome = self.attempt(number, split, text, second)
            self.outputs.append(outcome.output)
            self.count_stops(number, fault, outcome.output)
            if fault and fault.kind in ("usr1", "disk-full", "another-split") and \
                    "stopping at step" not in outcome.output and \
                    "could not write checkpoint" not in outcome.output:
                fault.triggered = False
            if fault and fault.kind.startswith("kill") and outcome.returncode != -9:
                fault.triggered = False
            self.remember_complete()
            if os.path.exists(self.canary):
                self.report.problems.append(f"attempt {number}: a planted pickle's code ran")
            if outcome.returncode not in (0, -9) and not (
                    fault and fault.kind == "disk-full" and fault.triggered):
                self.report.problems.append(f"attempt {number} ended with exit code "
                                            f"{outcome.returncode}:\n{outcome.output[-3000:]}")
                break
            done = outcome.returncode == 0 and "final valid loss" in outcome.output
            if done and not fault_attempt:
                break
            if number > attempts + 20:
                self.report.problems.append("the run did not reach its end")
                break
        self.report.attempts = number
        self.report.seconds = time.monotonic() - start
        return self.report

    # -- the checks at the end

    def check(self, reference: str) -> Report:
        problems = self.report.problems
        everything = "\n".join(self.outputs)
        for fault in self.report.faults:
            if fault.triggered and fault.expect:
                later = "\n".join(self.outputs_from(fault.attempt))
                fault.reported = re.search(fault.expect, later) is not None
                if not fault.reported:
                    problems.append(f"{fault.kind} ({fault.detail}, attempt {fault.attempt}) "
                                    f"not reported: no line matches {fault.expect!r}")
        if f"step {NAN_STEP}: loss or gradient not finite" not in everything:
            problems.append(f"the NaN at step {NAN_STEP} was never reported")
        tolerance = self.tolerance if self.report.split_changed else None
        problems.extend(compare_runs(self.out, reference, self.steps, tolerance,
                                     self.report.differences))
        problems.extend(self.lost_checkpoints())
        if os.path.exists(self.canary):
            problems.append("a planted pickle's code ran")
        return self.report

    def count_stops(self, number: int, fault: Optional[Fault], output: str) -> None:
        """The SIGUSR1 every attempt of the schedule gets (a preemption) counts as a fault of
        its own when it stopped the attempt."""
        match = re.search(r"stopping at step (\d+) on SIGUSR1", output)
        if match and not (fault and fault.kind in ("usr1", "another-split")):
            self.report.faults.append(Fault("usr1", number, f"step {match.group(1)}",
                                            expect=re.escape(match.group(0))))

    def outputs_from(self, attempt: int) -> List[str]:
        """Every output of attempt `attempt` and after (its second job's included)."""
        logs = sorted(glob.glob(os.path.join(self.root, "attempt*.log")))
        texts = []
        for log in logs:
            number = int(os.path.basename(log)[7:10])
            if number >= attempt:
                with open(log, errors="replace") as f:
                    texts.append(f.read())
        return texts

    def lost_checkpoints(self) -> List[str]:
        present = {}
        for path in glob.glob(os.path.join(self.checkpoints, "**", "manifest.json"),
                              recursive=True):
            try:
                present[manifest.digest(os.path.dirname(path))] = True
            except OSError:
                pass
        steps_present = [folders.step_of(os.path.basename(p)) for p in glob.glob(
            os.path.join(self.checkpoints, "**", "step*"), recursive=True)
            if os.path.isdir(p) and folders.TAG.match(os.path.basename(p))]
        lost = []
        for digest, step in self.seen.items():
            newer = sum(s > step for s in steps_present)
            if digest not in present and newer < self.keep:
                lost.append(f"step{step} (manifest {digest[:12]}) was complete and is gone, "
                            f"with only {newer} newer checkpoints left")
        return lost


def port_taken(outcome: Outcome) -> bool:
    """torchrun could not listen on the port free_port chose (another process took it since):
    nothing of the run started, and the attempt is made again on another port."""
    return outcome.returncode != 0 and "EADDRINUSE" in outcome.output and \
        "exit worker" not in outcome.output and "tupe-pretrain" not in outcome.output


def final_files(run: str, steps: int) -> dict:
    step_dir = os.path.join(run, "checkpoints", f"step{steps}")
    return {os.path.basename(p): safe_load.load(p) for p in sorted(
        glob.glob(os.path.join(step_dir, "*_states.pt")))}


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
                 measured: dict, weights_only: bool = False) -> List[str]:
    """The final checkpoint's weights and optimizer state (`weights_only`: the weights, for runs
    on other layouts), and the logged losses, against the uninterrupted run's: equal bit for bit
    (`tolerance` None), else within `tolerance` (absolute for tensors, relative for losses).
    `measured` gets the largest differences found."""
    problems = []
    mine, theirs = final_files(run, steps), final_files(reference, steps)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=120, help="attempts with faults, per seed")
    p.add_argument("--seeds", default="1", help="comma-separated seeds, one schedule each")
    p.add_argument("--steps", type=int, help="the run's steps (default: 2 per attempt)")
    p.add_argument("--same-split", action="store_true",
                   help="never change the split: the end must equal the reference bit for bit")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "chaos"))
    p.add_argument("--data", help="a tupe-prep folder (default: one novel of data/sample, "
                                  "prepared into OUT/prep)")
    p.add_argument("--tolerance", type=float, default=1e-6,
                   help="where the split changed: the largest difference allowed (absolute for "
                        "the state, relative for losses)")
    p.add_argument("--control", action="store_true",
                   help="also run the uninterrupted run on 1 process in micro-batches of 4 and "
                        "report how far it ends from the one on 2 (what a change of split alone "
                        "does, in fp32)")
    p.add_argument("--json", help="write the reports here")
    args = p.parse_args(argv)
    data = args.data or prepared_sample(args.out)
    reports = []
    for seed in map(int, args.seeds.split(",")):
        root = os.path.join(args.out, f"seed{seed}")
        shutil.rmtree(os.path.join(root, "run"), ignore_errors=True)
        for log in glob.glob(os.path.join(root, "attempt*.log")):
            os.remove(log)
        os.makedirs(root, exist_ok=True)
        chaos = Chaos(data, root, seed, steps=args.steps or 2 * args.attempts,
                      split_changes=not args.same_split, tolerance=args.tolerance)
        reference = chaos.reference()
        chaos.run(args.attempts)
        summary = chaos.check(reference).summary()
        if args.control:
            control, measured = chaos.reference(os.path.join(root, "control"), (1, 4)), {}
            compare_runs(control, reference, chaos.steps, math.inf, measured, weights_only=True)
            summary["control_differences"] = measured
        reports.append(summary)
        print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 1 if any(r["problems"] for r in reports) else 0


def prepared_sample(out: str) -> str:
    from data_prep.pipeline import PrepConfig, prepare

    folder = os.path.join(out, "prep")
    if not os.path.exists(os.path.join(folder, "train.idx")):
        prepare(PrepConfig(inputs=[os.path.join(ROOT, "data", "sample", "persuasion.txt.gz")],
                           output=folder, vocab_size=1000, workers=1, valid_fraction=0.05,
                           quiet=True))
    return folder


if __name__ == "__main__":
    sys.exit(main())
