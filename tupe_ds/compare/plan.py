"""A comparison: one pretraining run per (encoding, seed), the same data, model and
hyper-parameters otherwise, and optionally a fine-tune of each on GLUE tasks, kept in
OUT/compare.json so that every command (run, report, a Slurm array task) works from the same
list."""

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from tupe_ds.finetune.tasks import TASKS, TaskDataError, check_glue_task, glue_files
from tupe_ds.machine.doctor import probe
from tupe_ds.tools.files import write_atomically
from tupe_ds.train.checkpoint import latest_step
from tupe_ds.train.config import load

PLAN_FILE = "compare.json"
# tupe-compare sets these for every run; the other tupe-pretrain flags are shared by all runs.
RESERVED_FLAGS = ("--data", "--out", "--pos-encoding", "--seed", "--steps", "--resume",
                  "--check-only")


class CompareError(Exception):
    pass


@dataclass(frozen=True)
class Run:
    encoding: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.encoding}-seed{self.seed}"


@dataclass(frozen=True)
class Plan:
    out: str
    data: tuple  # tupe-pretrain's --data values: a folder, or weights and folders
    encodings: tuple
    seeds: tuple
    steps: int
    baseline: str  # the encoding whose final validation loss the others race to
    processes: int  # per run
    pretrain_flags: tuple  # --model, --objective, --ds-config, ... shared by every run
    finetune: Optional[str] = None  # a folder of GLUE tasks in GLUE's layout
    tasks: tuple = ()  # fine-tuned on
    finetune_flags: tuple = ()  # tupe-finetune's flags for every fine-tune (the grid, epochs)

    @property
    def runs(self) -> list:
        """Encoding-major: a Slurm array task's index is a position in this list."""
        return [Run(encoding, seed) for encoding in self.encodings for seed in self.seeds]

    @property
    def finetunes(self) -> list:
        """(run, task), run-major: a fine-tune array task's index is a position in this list."""
        return [(run, task) for run in self.runs for task in self.tasks]

    def run_dir(self, run: Run) -> str:
        return os.path.join(self.out, "runs", run.name)

    def trained_steps(self, run: Run) -> int:
        """The step of the run's latest complete checkpoint (0: none)."""
        return latest_step(os.path.join(self.run_dir(run), "checkpoints"))

    def export_dir(self, run: Run) -> str:
        return os.path.join(self.out, "exports", run.name)

    def finetune_dir(self, run: Run) -> str:
        """tupe-finetune --out of every task of the run: TASK.json, results.md, ..."""
        return os.path.join(self.out, "finetune", run.name)

    def finetune_argv(self, run: Run, task: str) -> list:
        train, dev = glue_files(self.finetune, TASKS[task])
        return ["--model", self.export_dir(run), "--task", task, "--train", train, "--valid",
                *(f"{name}={path}" for name, path in dev.items()), "--out",
                self.finetune_dir(run), *self.finetune_flags]

    def pretrain_argv(self, run: Run) -> list:
        return ["--data", *self.data, "--out", self.run_dir(run), "--pos-encoding", run.encoding,
                "--seed", str(run.seed), "--steps", str(self.steps), *self.pretrain_flags]

    def check(self) -> None:
        """tupe-pretrain's own checks on every run's flags, for `processes` processes."""
        for flag in RESERVED_FLAGS:
            if any(f == flag or f.startswith(flag + "=") for f in self.pretrain_flags):
                raise CompareError(f"{flag}: tupe-compare sets it for every run; give the "
                                   "comparison's --data, --encodings, --seeds and --steps instead")
        if self.baseline not in self.encodings:
            raise CompareError(f"--baseline {self.baseline} is not one of --encodings "
                               f"{','.join(self.encodings)}")
        for task in self.tasks:
            try:
                check_glue_task(self.finetune, TASKS[task])
            except TaskDataError as error:
                raise CompareError(f"--finetune {self.finetune}, task {task}: {error}") from None
        machine = probe()
        for run in self.runs:
            try:
                load(self.pretrain_argv(run), world_size=self.processes, machine=machine)
            except SystemExit as error:
                message = str(error).replace("tupe-pretrain: error: ", "")
                raise CompareError(f"run {run.name}: {message}") from None

    def save(self) -> None:
        """OUT/compare.json; a folder planned with other data or flags is refused."""
        path = os.path.join(self.out, PLAN_FILE)
        if os.path.exists(path):
            before = read_plan(self.out)
            for field in ("data", "pretrain_flags"):
                if getattr(before, field) != getattr(self, field):
                    raise CompareError(
                        f"{path}: this comparison was started with {field} "
                        f"{getattr(before, field)!r}, not {getattr(self, field)!r}; use another "
                        "--out, or the same flags (--encodings, --seeds, --steps and the "
                        "fine-tuning flags may change)")
        os.makedirs(self.out, exist_ok=True)
        write_atomically(path, json.dumps(asdict(self), indent=1))


def read_plan(out: str) -> Plan:
    path = os.path.join(out, PLAN_FILE)
    try:
        with open(path) as f:
            fields = json.load(f)
    except FileNotFoundError:
        raise CompareError(f"{path}: no such file; start the comparison with tupe-compare run "
                           f"(or plan) --out {out}") from None
    data = fields["data"]  # a plan of an earlier version holds one folder
    fields.update(out=out, data=(data,) if isinstance(data, str) else tuple(data),
                  encodings=tuple(fields["encodings"]), seeds=tuple(fields["seeds"]),
                  pretrain_flags=tuple(fields["pretrain_flags"]),
                  tasks=tuple(fields.get("tasks", ())),
                  finetune_flags=tuple(fields.get("finetune_flags", ())))
    return Plan(**fields)
