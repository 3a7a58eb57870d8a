"""Chaos: one tiny fp32 training run driven to its end through a seeded random schedule of
faults, then compared with the same run left alone.

The run is tupe-pretrain under torchrun (2 CPU ranks, ZeRO-2), through
tests/support/fault_worker.py, which injects the faults a process can suffer. Each attempt starts the
same command (a resume, after the first); what goes wrong in it, and to the run folder between
attempts, is drawn from the seed:

- in an attempt (tests/support/fault_worker.py): SIGKILL of every rank and the launcher mid-step, after
  a checkpoint file (mid-save), between the manifest and `latest`, after `latest`, during
  retention's deletion (drawn where retention has a checkpoint to delete); SIGUSR1 to one rank
  (preemption: save and stop); a full disk (every checkpoint file of one save fails with
  ENOSPC); reads of checkpoint files failing with EIO for less than the retry window
  (TUPE_DS_READ_RETRY_SECONDS) or for the whole attempt; another job taking the run folder over
  while the run trains (its record put in run.lock, as a taker does; removed after the attempt,
  that job being gone); a second job started on the same folder while the first trains; the
  next attempt on another data-parallel size or micro-batch split;
- between attempts, in the newest complete checkpoint (when an older one is there to fall back
  to) or the run folder: a file truncated, a byte flipped, a file deleted, a file added that the
  manifest does not list, a pickle that would run code (listed with a rewritten manifest,
  unlisted, or under another file's name), a damaged manifest.json, layout.json, `latest`,
  run.json or run.lock, a lock left by a process that died;
- in every attempt and in the uninterrupted run alike: NaN in rank 0's loss at NAN_STEP (a step
  the run must skip, on every rank, each time it trains it).

Every fault must fire (the worker prints "fault fired: ..." as it injects one) and be reported
by a line only its reaction prints, in the attempt where the reaction shows (a kill: the next
attempt's take-over of the killed process's run.lock, or the setting aside of the step folder
it cut short). At the end: the weights, the optimizer state and the logged losses equal the
uninterrupted run's, and so do the random generators of every rank (rng_rankR.pt), bit for bit
when every attempt had the same split; train_log.jsonl holds each step once; no complete
checkpoint was lost (one that vanished from checkpoints/ and set-aside/ in an attempt left
--keep-checkpoints newer complete ones among the live step folders: retention removed it); no
pickle's code ever ran.

Dropout (hidden and attention) is DROPOUT where the split never changes. Where it may, dropout
is 0 and the end is compared within a tolerance, random state aside: a resume on another layout
derives each rank's generators anew from (seed, step, rank) (tupe_ds/train/checkpoint/rng.py),
so with dropout the run would draw other masks than the uninterrupted one from then on.

    python bench/chaos.py --attempts 120 --seeds 1 --out build/chaos   # a few hundred faults
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

from bench import chaos_table  # noqa: E402
from tupe_ds.distributed import launchers  # noqa: E402
from tupe_ds.tools.lock import this_holder  # noqa: E402
from tupe_ds.train import run_lock  # noqa: E402
from tupe_ds.train.checkpoint import folder as folders  # noqa: E402
from tupe_ds.train.checkpoint import manifest, safe_load  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
NAN_STEP = 7
NAN_RANK = 0  # every split has it
REFERENCE_SPLIT = (2, 8)  # processes, micro-batch: global batch 16 = 8 x 1 x dp 2
SPLITS = [(2, 8), (2, 4), (1, 8), (1, 4)]
DROPOUT = 0.1
READ_RETRY_SECONDS = 2  # TUPE_DS_READ_RETRY_SECONDS of every attempt
SHORT_EIO_SECONDS = 0.5  # within it
PROCESS_FAULTS = ["kill-mid-step", "kill-after-file", "kill-after-manifest", "kill-after-latest",
                  "kill-during-deletion", "usr1", "disk-full", "eio-short", "eio-long",
                  "taken-over", "second-job", "another-split"]
SAVE_FAULTS = ("kill-after-file", "kill-after-manifest", "kill-after-latest",
               "kill-during-deletion", "disk-full")
STOPPING_FAULTS = ("disk-full", "eio-long", "taken-over")  # end their attempt with exit code 3
FILE_FAULTS = ["truncated", "flipped", "missing", "unlisted", "pickle-listed", "pickle-unlisted",
               "pickle-renamed", "manifest", "layout", "latest", "run.json", "run.lock",
               "dead-holder"]
FOLDER_TARGETS = {"latest": "latest", "run.json": "run.json", "run.lock": "run.lock",
                  "dead-holder": "run.lock"}  # what the other file faults hit: the checkpoint


@dataclass
class Fault:
    kind: str
    attempt: int  # the attempt it is injected in, or before (a fault in the folder)
    detail: str = ""
    expect: Optional[str] = None  # a text only its reaction prints (None: it says nothing)
    text: Optional[str] = None  # its TUPE_DS_FAULT text (a fault in the attempt)
    shows_in: Optional[int] = None  # the attempt whose output shows the reaction (None: attempt)
    step: int = 0  # the step it is set for (a take-over: the step it comes in)
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


def free_port() -> str:
    return str(launchers.free_port())


def environment(fault: str) -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TUPE_DS_FAULT": fault,
            "TUPE_DS_READ_RETRY_SECONDS": str(READ_RETRY_SECONDS),
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))}


class Chaos:
    def __init__(self, data: str, root: str, seed: int, steps: int = 16, keep: int = 2,
                 split_changes: bool = True, cover: bool = False, timeout: float = 300,
                 tolerance: float = 1e-6, kinds: Optional[list] = None):
        """`cover`: the kinds of faults in a shuffled cycle, each attempt one file fault and one
        process fault, so that a short schedule holds every kind (tests/test_chaos.py); else
        drawn independently (0-2 file faults an attempt). `kinds`: the kinds drawn (default:
        all; another-split only with `split_changes`)."""
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
        self.lock_path = os.path.join(self.out, run_lock.LOCK_FILE)
        self.canary = os.path.join(root, "canary-code-ran")
        self.report = Report(seed)
        self.outputs: List[str] = []
        self.seen = {}  # manifest digest -> step of every complete checkpoint seen
        self.killed_holder = None  # the PID in run.lock after an attempt was killed
        self.read_stopped = set()  # attempts that stopped on a read error, before any resume

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

    def draw(self, kinds: list, usable=lambda kind: True) -> Optional[str]:
        """A kind of `kinds` that is `usable` now (None: none is); in `cover` mode the next of
        the cycle that is, the others staying in it for the next draws."""
        if not self.cover:
            choices = [kind for kind in kinds if usable(kind)]
            return self.random.choice(choices) if choices else None
        cycle = self.cycles.setdefault(tuple(kinds), [])
        if not cycle:
            cycle.extend(self.random.sample(kinds, len(kinds)))
        kind = next((kind for kind in reversed(cycle) if usable(kind)), None)
        if kind is not None:
            cycle.remove(kind)
        return kind

    def forget(self, step_dir: str) -> None:
        """A checkpoint whose manifest the schedule itself rewrites is no longer the one seen."""
        self.seen.pop(manifest.digest(step_dir), None)

    # -- faults in an attempt

    def process_faults(self, attempt: int, split) -> tuple:
        """(TUPE_DS_FAULT text, the attempt's faults, its split). Every attempt of the schedule
        also stops (SIGUSR1) a few steps on, a fault of its own where the drawn one does not end
        the attempt first; an attempt on another split than the uninterrupted run's stops before
        the last step, so that the last checkpoint is written on the uninterrupted run's
        layout."""
        fault, split = self.drawn_process_fault(attempt, split)
        faults, texts = ([fault], [fault.text]) if fault else ([], [])
        if self.position() < self.steps - 1:
            stop = min(self.steps - 1, self.position() + 4)
            texts.append(f"usr1:0:{stop}")
            if fault is None or fault.kind in ("eio-short", "second-job"):
                faults.append(Fault("usr1", attempt, f"the schedule's stop at step {stop}",
                                    f"stopping at step {stop} on SIGUSR1", texts[-1]))
        return ";".join(texts), faults, split

    def drawn_process_fault(self, attempt: int, split) -> tuple:
        """(Fault or None, split of the attempt)."""
        at = self.position()
        if at >= self.steps - 1:
            return None, REFERENCE_SPLIT
        saves = [s for s in range(at + 1, min(at + 4, self.steps - 1) + 1) if s % 2 == 0]

        def usable(kind: str) -> bool:
            if kind == "kill-during-deletion":  # the second save deletes what the first kept
                return len(saves) == 2 and at > 0
            return (kind not in SAVE_FAULTS or saves) and (not kind.startswith("eio") or at > 0)

        kind = self.draw(self.process_kinds, usable)
        if kind is None:
            return None, split
        step = at + self.random.randint(1, min(3, self.steps - 1 - at))
        save_step = saves[-1] if kind == "kill-during-deletion" else \
            self.random.choice(saves) if saves else None
        fault = Fault(kind, attempt, f"step {step}", step=step)
        if kind == "another-split":
            split = self.random.choice([s for s in SPLITS if s != split])
            processes, micro = split
            said = (f"micro-batch {micro} x accumulation {16 // (micro * processes)} x dp "
                    f"{processes}")
            # stopped before the end, so that the last attempt writes the reference's layout
            fault.text, fault.detail = f"usr1:0:{step}", f"{said} until step {step}"
            fault.expect = f"(resumed at|starting) step \\d+ of \\d+: .*{said}"
        elif kind.startswith("kill"):
            fault.shows_in = attempt + 1  # expect: once the kill names the process (judge)
            fault.text, fault.detail = f"{kind}:{save_step}", f"save of step{save_step}"
            if kind == "kill-mid-step":
                fault.text, fault.detail = f"{kind}:{step}", f"step {step}"
            elif kind == "kill-after-file":
                pattern = self.random.choice(["mp_rank_00_model_states.pt", "zero_pp_rank_1_*",
                                              "zero_pp_rank_0_*"])
                if split[0] == 1 and pattern == "zero_pp_rank_1_*":
                    pattern = "zero_pp_rank_0_*"
                fault.text, fault.detail = f"{kind}:{pattern}:{save_step}", \
                    f"{pattern} of step{save_step}"
                fault.expect = (f"tupe-pretrain: (step\\d+, )*step{save_step}(, step\\d+)* "
                                "\\(.*moved to")
        elif kind == "usr1":
            rank = self.random.randrange(split[0])
            fault.text, fault.detail = f"usr1:{rank}:{step}", f"rank {rank} at step {step}"
            fault.expect = f"stopping at step {step} on SIGUSR1"
        elif kind == "disk-full":
            fault.text, fault.detail = f"disk-full:{save_step}", f"save of step{save_step}"
            fault.expect = f"could not write checkpoint step{save_step} .*No space left"
        elif kind.startswith("eio"):
            seconds = SHORT_EIO_SECONDS if kind == "eio-short" else math.inf
            fault.text, fault.detail = f"eio:{seconds}", f"reads of checkpoints for {seconds} s"
            fault.expect = (f"tupe-pretrain: reading {re.escape(self.checkpoints)}/\\S+ failed "
                            f"\\(\\[Errno 5\\] Input/output error\\); trying again" if
                            kind == "eio-short" else
                            f"could not read {re.escape(self.checkpoints)}/\\S+ \\(\\[Errno 5\\] "
                            "Input/output error\\).*: nothing was moved or deleted")
        else:  # another job takes the folder over, or a second one is refused, during `step`
            fault.text, fault.detail = f"hold:{step}:{self.hold(attempt)}", \
                f"while step {step} trains"
            fault.expect = ("this run no longer holds its run folder" if kind == "taken-over"
                            else "this run folder is in use by")
        return fault, split

    def hold(self, attempt: int) -> str:
        return os.path.join(self.root, f"attempt{attempt:03d}.hold")

    # -- faults between attempts

    def file_fault(self, attempt: int, hit: set) -> Optional[Fault]:
        """One fault between attempts; `hit`: what the attempt's faults damaged so far (the
        newest checkpoint, the lock, ...): one fault a target, so that none hides another. The
        newest checkpoint only where an older one is there to fall back to (with none the run
        refuses to start over from step 0); the lock not where a killed attempt left its own,
        which the next attempt must take over."""
        complete = self.complete()

        def usable(kind: str) -> bool:
            target = FOLDER_TARGETS.get(kind, "checkpoint")
            if target in hit:
                return False
            if target == "checkpoint":
                return len(complete) >= 2
            return {"latest": os.path.isdir(self.checkpoints),
                    "run.json": os.path.exists(os.path.join(self.out, "run.json")),
                    "run.lock": self.killed_holder is None}[target]

        kind = self.draw(self.file_kinds, usable)
        if kind is None:
            return None
        hit.add(FOLDER_TARGETS.get(kind, "checkpoint"))
        if kind in FOLDER_TARGETS:
            return self.folder_fault(kind, attempt)
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
            with open(os.path.join(self.checkpoints, "latest"), "wb") as f:
                f.write(os.urandom(12))
            return Fault(kind, attempt, "checkpoints/latest (informative only)")
        if kind == "run.json":
            with open(os.path.join(self.out, "run.json"), "w") as f:
                f.write('{"objective": ')
            return Fault(kind, attempt, "run.json", expect="run.json: not readable")
        os.makedirs(self.out, exist_ok=True)
        if kind == "run.lock":
            with open(self.lock_path, "wb") as f:
                f.write(b"\x00\x01 not a lock")
            return Fault(kind, attempt, "run.lock", expect="took over .*run.lock .*damaged")
        gone = subprocess.Popen(["true"])
        gone.wait()
        with open(self.lock_path, "w") as f:
            json.dump({**this_holder(), "pid": gone.pid, "pid_start": 1,
                       "started": "earlier"}, f)
        return Fault(kind, attempt, f"run.lock of process {gone.pid}, ended",
                     expect=f"took over .*run.lock from process {gone.pid} .*ended")

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
        return self.report

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

    # -- the checks

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


def port_taken(outcome: Outcome) -> bool:
    """torchrun could not listen on the port free_port chose (another process took it since):
    nothing of the run started, and the attempt is made again on another port."""
    return outcome.returncode != 0 and "EADDRINUSE" in outcome.output and \
        "exit worker" not in outcome.output and "tupe-pretrain" not in outcome.output


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=120, help="attempts with faults, per seed")
    p.add_argument("--seeds", default="1", help="comma-separated seeds, one schedule each")
    p.add_argument("--steps", type=int, help="the run's steps (default: 2 per attempt)")
    p.add_argument("--same-split", action="store_true",
                   help=f"never change the split: dropout {DROPOUT}, and the end (random state "
                        "included) must equal the reference bit for bit")
    p.add_argument("--kinds", help="comma-separated kinds of faults to draw (default: all): "
                                   + ", ".join(PROCESS_FAULTS + FILE_FAULTS))
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
    kinds = args.kinds.split(",") if args.kinds else None
    if set(kinds or ()) - set(PROCESS_FAULTS + FILE_FAULTS):
        p.error(f"--kinds: no such kind: {set(kinds) - set(PROCESS_FAULTS + FILE_FAULTS)}")
    data = args.data or prepared_sample(args.out)
    reports = []
    for seed in map(int, args.seeds.split(",")):
        root = os.path.join(args.out, f"seed{seed}")
        shutil.rmtree(os.path.join(root, "run"), ignore_errors=True)
        for log in glob.glob(os.path.join(root, "attempt*.log")):
            os.remove(log)
        os.makedirs(root, exist_ok=True)
        chaos = Chaos(data, root, seed, steps=args.steps or 2 * args.attempts,
                      split_changes=not args.same_split, tolerance=args.tolerance,
                      kinds=kinds)
        reference = chaos.reference()
        chaos.run(args.attempts)
        summary = chaos.check(reference).summary()
        if args.control:
            control, measured = chaos.reference(os.path.join(root, "control"), (1, 4)), {}
            compare_runs(control, reference, chaos.steps, math.inf, measured, weights_only=True)
            summary["control_differences"] = measured
        reports.append(summary)
        print(json.dumps(summary, indent=1), flush=True)
    print(chaos_table.markdown(chaos_table.added(r["by_kind"] for r in reports)))
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
