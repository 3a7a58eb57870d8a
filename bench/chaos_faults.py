"""The chaos test's faults: their kinds, and how the schedule draws each from its seed and
injects it, in an attempt or in the run folder between attempts.

A fault in an attempt is a TUPE_DS_FAULT text that tests/support/fault_worker.py carries out; a
fault between attempts is written here, into the newest complete checkpoint or the run folder.
Each Fault carries the line only its reaction prints, which bench/chaos_report.py looks for.
"""

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

import torch

from tupe_ds.tools.lock import this_holder
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import manifest

NAN_STEP = 7
NAN_RANK = 0  # every split has it
REFERENCE_SPLIT = (2, 8)  # processes, micro-batch: global batch 16 = 8 x 1 x dp 2
SPLITS = [(2, 8), (2, 4), (1, 8), (1, 4)]
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


class FaultInjection:
    """The faults of a Chaos schedule (bench/chaos_harness.py), mixed into it: drawn from its
    `random`, into the run folder it runs in (`out`, `checkpoints`, `lock_path`), where the run
    is as the folder shows it (`complete()`, `position()`)."""

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
