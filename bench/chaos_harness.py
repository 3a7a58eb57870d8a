"""The chaos test's harness: one training run started again and again through the fault
worker, each attempt with the faults drawn for it, until the run reaches its end.

Chaos runs one seeded schedule: tupe-pretrain under torchrun (2 CPU ranks, ZeRO-2) through
tests/support/fault_worker.py, and the uninterrupted run to compare with (reference). Its faults
are drawn and injected by FaultInjection (bench/chaos_faults.py); each attempt is judged, and
the end checked, by Checks (bench/chaos_report.py), into its Report.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional

from bench.chaos_faults import (FILE_FAULTS, NAN_RANK, NAN_STEP, PROCESS_FAULTS,
                                READ_RETRY_SECONDS, REFERENCE_SPLIT, Fault, FaultInjection)
from bench.chaos_report import Checks, Outcome, Report
from tupe_ds.distributed import launchers
from tupe_ds.tools.errors import HistoryDamaged
from tupe_ds.tools.lock import this_holder
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import history, manifest
from tupe_ds.train.run_folder import lock as folder_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
DROPOUT = 0.1


def free_port() -> str:
    return str(launchers.free_port())


def environment(fault: str) -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TUPE_DS_FAULT": fault,
            "TUPE_DS_READ_RETRY_SECONDS": str(READ_RETRY_SECONDS),
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))}


class Chaos(FaultInjection, Checks):
    def __init__(self, data: str, root: str, seed: int, steps: int = 16, keep: int = 2,
                 split_changes: bool = True, cover: bool = False, timeout: float = 300,
                 tolerance: float = 1e-6, kinds: Optional[list] = None, script: str = ""):
        """`cover`: the kinds of faults in a shuffled cycle, each attempt one file fault and one
        process fault, so that a short schedule holds every kind (tests/test_chaos.py); else
        drawn independently (0-2 file faults an attempt). `kinds`: the kinds drawn (default:
        all; another-split only with `split_changes`). `script`: a consent the job's script
        keeps once given, as a requeue repeats it: "fresh-start" (every attempt), "resume-from"
        (--resume-from stepK in every attempt after one found two complete checkpoints, K the
        oldest: a go-back that gives up the newer): each applies once at most, the run ending
        as the uninterrupted one (`consents_spent`)."""
        self.data, self.root, self.steps, self.keep = data, root, steps, keep
        self.random = random.Random(seed)
        self.cover, self.tolerance = cover, tolerance
        self.cycles = {}
        self.split_changes, self.timeout = split_changes, timeout
        self.dropout = 0.0 if split_changes else DROPOUT
        drawn = set(kinds or PROCESS_FAULTS + FILE_FAULTS)
        self.process_kinds = [k for k in PROCESS_FAULTS if k in drawn and (
            split_changes or k != "another-split")]
        self.file_kinds = [k for k in FILE_FAULTS if k in drawn]
        self.out = os.path.join(root, "run")
        self.checkpoints = os.path.join(self.out, "checkpoints")
        self.lock_path = os.path.join(self.out, folder_lock.LOCK_FILE)
        self.canary = os.path.join(root, "canary-code-ran")
        self.report = Report(seed)
        self.outputs: List[str] = []
        self.seen = {}  # manifest digest -> step of every complete checkpoint seen
        self.killed_holder = None  # the PID in run.lock after an attempt was killed
        self.read_stopped = set()  # attempts that stopped on a read error, before any resume
        self.script, self.script_flags = script, ["--fresh-start"] if script == "fresh-start" \
            else []

    def command(self, split, *extra) -> list:
        processes, micro = split
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(processes), "--master_port", free_port(), WORKER, "pretrain",
                "--data", self.data, "--model", "tiny", "--ds-config", CPU_CONFIG,
                "--seq-len", "64", "--log-interval", "1", "--eval-samples", "32",
                "--steps", str(self.steps), "--save-interval", "2",
                "--eval-interval", str(self.steps), "--dropout", str(self.dropout),
                "--lr", "2e-3", "--warmup-steps", "2", "--keep-checkpoints", str(self.keep),
                "--micro-batch", str(micro), *extra]

    def launch(self, out: str, split, fault: str, log: str) -> subprocess.Popen:
        nan = f"nan-loss:{NAN_RANK}:{NAN_STEP}"
        flags = self.script_flags if out == self.out else []
        with open(log, "w") as f:
            return subprocess.Popen(self.command(split, "--out", out, *flags), stdout=f,
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
        """The uninterrupted run (with the same NaN step and dropout), in `out` (default
        ROOT/reference-dropoutP): run when that folder does not hold it yet."""
        out = out or os.path.join(self.root, f"reference-dropout{self.dropout:g}")
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

    # -- one attempt

    def attempt(self, number: int, split, fault_text: str, faults: List[Fault]) -> Outcome:
        log = os.path.join(self.root, f"attempt{number:03d}.log")
        held = next((f for f in faults if f.kind in ("second-job", "taken-over")), None)
        for _ in range(3):
            for path in (self.hold(number), self.hold(number) + ".waiting"):
                if os.path.exists(path):  # a try cut short before it held
                    os.remove(path)
            start = time.monotonic()
            process = self.launch(self.out, split, fault_text, log)
            if held:
                held.triggered = self.while_held(number, process, (
                    self.second_job if held.kind == "second-job" else self.take_over))
            outcome = self.finish(process, log, start)
            if not port_taken(outcome):
                return outcome
        return outcome

    def while_held(self, number: int, first: subprocess.Popen, action) -> bool:
        """Once the attempt's `hold` fault holds rank 0 in its step: action(number), then the
        attempt goes on. False when it ended before (action not taken)."""
        hold = self.hold(number)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and first.poll() is None and \
                not os.path.exists(hold + ".waiting"):
            time.sleep(0.2)
        held = first.poll() is None and os.path.exists(hold + ".waiting")
        try:
            if held:
                action(number)
        finally:
            open(hold, "w").close()  # the first goes on
        return held

    def second_job(self, number: int) -> None:
        """The same command again on the same folder: refused."""
        second_log = os.path.join(self.root, f"attempt{number:03d}-second.log")
        for _ in range(3):
            outcome = self.finish(self.launch(self.out, (1, 8), "", second_log), second_log,
                                  time.monotonic())
            if not port_taken(outcome):
                break
        if outcome.returncode == 0:
            self.report.problems.append(f"attempt {number}: a second job on the same folder "
                                        "was not refused")

    def take_over(self, number: int) -> None:
        """Another job's record in run.lock, put there as a taker does (a file of its own
        renamed over the lock): a holder on another node, its lease just renewed."""
        self.taker = {**this_holder(), "host": "another-node", "boot_id": "another",
                      "pid": 4242, "started": f"by the chaos test in attempt {number}"}
        with open(self.lock_path + ".taker", "w") as f:
            json.dump(self.taker, f)
        os.replace(self.lock_path + ".taker", self.lock_path)

    def run(self, attempts: int) -> Report:
        start = time.monotonic()
        split, number = REFERENCE_SPLIT, 0
        while True:
            number += 1
            faults = []
            if number <= attempts:
                files = (number > 1) if self.cover else self.random.choice([0, 0, 1, 1, 2])
                hit = set()
                for _ in range(files):
                    faults.append(self.file_fault(number, hit))
                text, process_faults, split = self.process_faults(number, split)
                faults = [f for f in faults if f] + process_faults
            else:
                text, split = "", REFERENCE_SPLIT
            self.report.faults.extend(faults)
            self.report.split_changed |= split != REFERENCE_SPLIT
            if self.script == "resume-from" and not self.script_flags and \
                    len(complete := self.complete()) > 1:  # kept by every later attempt
                self.script_flags = ["--resume-from", folders.tag_of(min(complete))]
            if self.script_flags[:1] == ["--resume-from"] and not self.consent_applied():
                self.going_back(faults, folders.step_of(self.script_flags[1]))
            listed = self.listing()
            outcome = self.attempt(number, split, text, faults)
            self.outputs.append(outcome.output)
            if "could not read" in outcome.output:
                self.read_stopped.add(number)
            stopped = False
            for fault in faults:
                stopped |= self.judge(fault, outcome, listed)
            self.killed_holder = self.holder_pid() if outcome.returncode == -9 else None
            self.note_lost(number)
            self.remember_complete()
            if os.path.exists(self.canary):
                self.report.problems.append(f"attempt {number}: a planted pickle's code ran")
            if outcome.returncode not in (0, -9) and not stopped:
                self.report.problems.append(f"attempt {number} ended with exit code "
                                            f"{outcome.returncode}:\n{outcome.output[-3000:]}")
                break
            self.report.finished = outcome.returncode == 0 and \
                "final valid loss" in outcome.output and self.position() == self.steps
            if self.report.finished:
                break
            if number > attempts + 20:
                self.report.problems.append("the run did not reach its end")
                break
        self.report.attempts = number
        self.report.seconds = time.monotonic() - start
        self.consents_spent()
        return self.report

    def consent_applied(self) -> bool:
        """Whether the run's history records a consent applied (a damaged history: no)."""
        try:
            return any(r["kind"] == "consent" and r["outcome"] == "applied"
                       for r in history.read(self.out) or [])
        except HistoryDamaged:
            return False

    @staticmethod
    def going_back(faults: List[Fault], step: int) -> None:
        """The reaction to a fault in a checkpoint newer than `step`, which the attempt's
        --resume-from, not yet applied (an attempt that could not read stops before), gives
        up: that checkpoint set aside, unread."""
        for fault in faults:
            damaged = re.match(r"(step(\d+))/", fault.detail)
            if damaged and int(damaged.group(2)) > step:
                fault.expect = (f"tupe-pretrain: (step\\d+, )*{damaged.group(1)}(, step\\d+)* "
                                f"\\(newer than {folders.tag_of(step)}, the checkpoint resumed")

    def consents_spent(self) -> None:
        """The script's consent applied once at most (--fresh-start: never, on a folder whose
        first attempt found nothing to give up), whatever the attempts repeated."""
        if not self.script:
            return
        applied = [r for r in history.read(self.out) or [] if r["kind"] == "consent"
                   and r["outcome"] == "applied" and not r.get("rebuilt")]
        if len(applied) > (1 if self.script == "resume-from" else 0):
            self.report.problems.append(
                f"{self.script} kept by the job's script applied {len(applied)} times: "
                + "; ".join(f"{r['flag']} on {r['given_on']}" for r in applied))

    def holder_pid(self) -> Optional[int]:
        """The PID run.lock names (None: no lock, or not a record)."""
        try:
            with open(self.lock_path) as f:
                return json.load(f).get("pid")
        except (OSError, ValueError, AttributeError):
            return None

    def listing(self) -> List[str]:
        """Every path under checkpoints/, with its size: what an attempt moved or deleted."""
        return sorted(f"{os.path.relpath(os.path.join(folder, name), self.checkpoints)} "
                      f"{os.path.getsize(os.path.join(folder, name))}"
                      for folder, _, names in os.walk(self.checkpoints) for name in names)


def port_taken(outcome: Outcome) -> bool:
    """torchrun could not listen on the port free_port chose (another process took it since):
    nothing of the run started, and the attempt is made again on another port."""
    return outcome.returncode != 0 and "EADDRINUSE" in outcome.output and \
        "exit worker" not in outcome.output and "tupe-pretrain" not in outcome.output
