"""A comparison: one pretraining run per (encoding, seed), the same data, model and
hyper-parameters otherwise, and optionally a fine-tune of each on GLUE tasks, kept in
OUT/compare.json so that every command (run, report, a Slurm array task) works from the same
list. Its recipe (recipes.py) is kept there too, with the flags it adds."""

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Optional

from tupe_ds.compare.recipes import Recipe
from tupe_ds.finetune.tasks import TASKS, check_glue_task, glue_files
from tupe_ds.machine.doctor import probe
from tupe_ds.tools import command_line
from tupe_ds.tools.errors import CompareError, Refused, TaskDataError
from tupe_ds.tools.files import write_atomically
from tupe_ds.train.checkpoint.folder import latest_step
from tupe_ds.train.config import load
from tupe_ds.train.flags import parser as pretrain_parser

PLAN_FILE = "compare.json"
# tupe-compare sets these for every run; the other tupe-pretrain flags are shared by all runs.
RESERVED_FLAGS = ("--data", "--out", "--pos-encoding", "--seed", "--steps", "--resume",
                  "--check-only")
# tupe-compare's own: a run given one would train nothing, or take settings past these checks
ONE_COMMANDS = ("--help", "--print-config", "--config")


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
    recipe: Recipe = field(default_factory=Recipe)  # --recipe: what it adds to pretrain_flags

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
                "--seed", str(run.seed), "--steps", str(self.steps),
                *self.recipe.applied_to(self.pretrain_flags)]

    def check_flags(self) -> None:
        """What the comparison itself forbids: flags it sets, a baseline it does not train."""
        seen = set()
        for action, (given, *_) in command_line.flag_groups(self.pretrain_flags,
                                                            pretrain_parser()):
            names = action.option_strings if action else ()
            if action is not None and action.dest in ("model", "objective") and \
                    action.dest in seen:  # after tupe-compare's own, which come first
                raise CompareError(f"{given.split('=')[0]} among the flags for tupe-pretrain: "
                                   f"give it as tupe-compare's own --{action.dest}")
            seen.add(action.dest if action else None)
            if " " in given and given.startswith("-"):
                raise CompareError(f"{given!r} among the flags for tupe-pretrain: give the flag "
                                   f"and its value as items of their own ({given.split()})")
            if set(names) & set(RESERVED_FLAGS):
                raise CompareError(f"{given.split('=')[0]}: tupe-compare sets it for every run; "
                                   "give the comparison's --data, --encodings, --seeds and "
                                   "--steps instead")
            if set(names) & set(ONE_COMMANDS):
                raise CompareError(f"{given.split('=')[0]} among the flags for tupe-pretrain: "
                                   "give it to tupe-compare itself (a --config file of "
                                   "tupe-compare holds the runs' flags as pretrain-flags)")
        if self.baseline not in self.encodings:
            raise CompareError(f"--baseline {self.baseline} is not one of --encodings "
                               f"{','.join(self.encodings)}")

    def load_run(self, run: Run, argv: list, machine, scratch: dict):
        """tupe-pretrain's RunConfig of `run` from `argv` for `processes` processes; its refusal
        a CompareError, each scratch path in it named as {scratch path: the run's} says."""
        try:
            return load(argv, world_size=self.processes, machine=machine)
        except Refused as error:
            message = str(error)
            for path, meant in scratch.items():
                message = message.replace(path, meant)
            raise CompareError(f"run {run.name}: {message}") from None

    def first_run_config(self, machine):
        """tupe-pretrain's RunConfig of the first run on `machine` (the batch split and warmup a
        recipe scales to), in a scratch run folder: the run's own checkpoints, trained with the
        recipe's flags, would refuse a command without them."""
        run = self.runs[0]
        argv = self.pretrain_argv(run)
        with tempfile.TemporaryDirectory() as scratch:
            argv[argv.index("--out") + 1] = scratch
            return self.load_run(run, argv, machine, {scratch: self.run_dir(run)})

    def check(self) -> None:
        """tupe-pretrain's own checks on every run's flags (check_flags' done), a DeepSpeed config
        the recipe makes checked from a scratch copy (OUT is written by save() only). First, a
        comparison already in OUT that this one may not go on with."""
        self.refuse_another_plan()
        for task in self.tasks:
            try:
                check_glue_task(self.finetune, TASKS[task])
            except TaskDataError as error:
                raise CompareError(f"--finetune {self.finetune}, task {task}: {error}") from None
        machine = probe()
        made = self.recipe.ds_config_file
        with tempfile.TemporaryDirectory() as scratch:
            copy = os.path.join(scratch, os.path.basename(made or "none"))
            if made is not None:
                with open(copy, "w") as f:
                    json.dump(self.recipe.ds_config, f)
            for run in self.runs:
                argv = [copy if made is not None and flag == made else flag
                        for flag in self.pretrain_argv(run)]
                self.load_run(run, argv, machine, {copy: made} if made is not None else {})

    def save(self) -> None:
        """OUT/compare.json (and the recipe's DeepSpeed config); a folder planned with another
        recipe, other data or other flags is refused."""
        self.refuse_another_plan()
        os.makedirs(self.out, exist_ok=True)
        if self.recipe.ds_config is not None:  # before the plan that names it
            write_atomically(self.recipe.ds_config_file,
                             json.dumps(self.recipe.ds_config, indent=1))
        write_atomically(os.path.join(self.out, PLAN_FILE), json.dumps(asdict(self), indent=1))

    def refuse_another_plan(self) -> None:
        """CompareError where OUT holds a comparison this plan may not go on with: another
        recipe, other data or flags (the recipe's own included)."""
        path = os.path.join(self.out, PLAN_FILE)
        if not os.path.exists(path):
            return
        before = read_plan(self.out)
        if before.recipe.name != self.recipe.name:
            raise CompareError(
                f"{path}: this comparison was started with --recipe {before.recipe.name}, not "
                f"{self.recipe.name}; give the {self.recipe.name} recipe its own --out (Table 1 "
                f"and Figure 5 under both: one folder each), or --recipe {before.recipe.name}")
        for name in ("data", "pretrain_flags"):
            if getattr(before, name) != getattr(self, name):
                raise CompareError(
                    f"{path}: this comparison was started with {name} "
                    f"{getattr(before, name)!r}, not {getattr(self, name)!r}; use another "
                    "--out, or the same flags (--encodings, --seeds, --steps and the "
                    "fine-tuning flags may change)")
        if (before.recipe.flags, before.recipe.ds_config) != (self.recipe.flags,
                                                              self.recipe.ds_config):
            config = (f" and another {os.path.basename(self.recipe.ds_config_file)}"
                      if before.recipe.flags == self.recipe.flags else "")
            raise CompareError(
                f"{path}: --recipe {self.recipe.name} gave this comparison's runs "
                f"{' '.join(before.recipe.flags) or 'no flags'}, and would now give them "
                f"{' '.join(self.recipe.flags) or 'no flags'}{config}: it scales its decay and "
                "batch ramp to --steps and the batch split (--nproc, the machine's GPUs, "
                "--micro-batch, --global-batch), and its precision to this machine's GPUs and "
                "the --ds-config; use another --out, or the same --steps, --nproc, flags and "
                "--ds-config on a machine with the same GPUs")


def read_plan(out: str) -> Plan:
    path = os.path.join(out, PLAN_FILE)
    try:
        with open(path) as f:
            fields = json.load(f)
    except FileNotFoundError:
        raise CompareError(f"{path}: no such file; start the comparison with tupe-compare run "
                           f"(or plan) --out {out}") from None
    if isinstance(fields["data"], str):  # a plan of an earlier version holds one folder
        fields["data"] = [fields["data"]]
    fields = tuples(fields)
    recipe = fields.get("recipe")  # None: a plan written before recipes, the paper's
    fields.update(out=out, recipe=Recipe(**tuples(recipe)) if recipe else Recipe())
    return Plan(**fields)


def tuples(fields: dict) -> dict:
    """compare.json's `fields` with their lists as the tuples of a Plan or Recipe."""
    return {name: tuple(value) if isinstance(value, list) else value
            for name, value in fields.items()}
