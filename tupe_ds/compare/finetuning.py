"""A comparison's fine-tunes: each complete run's latest checkpoint exported (OUT/exports/NAME)
and fine-tuned by tupe-finetune on every task of the plan (OUT/finetune/NAME/TASK.json), under the
runs' launcher and number of processes, one after the other; or one Slurm array task each
(slurm/compare_finetune.sbatch, through `finetune_flags`).

A fine-tune is finished when its TASK.json holds the plan's grid under the current settings, the
export's source checkpoint included (tupe_ds.finetune.progress); any other is started, and
tupe-finetune skips the (learning rate, seed) results an earlier attempt kept. A failed one is
recorded in OUT/status.json and the next one starts.
"""

import json
import logging
import os
import re

from tupe_ds.compare.launching import launched, read_status, record_status
from tupe_ds.compare.plan import Plan, Run
from tupe_ds.distributed.launchers import launcher_command
from tupe_ds.export.read import read_export_description
from tupe_ds.finetune import run as tupe_finetune
from tupe_ds.finetune.flags import global_batch_size
from tupe_ds.finetune.progress import finetune_settings, finished
from tupe_ds.finetune.tasks import TASKS
from tupe_ds.tools.errors import CompareError, ExportError
from tupe_ds.tools.files import locked

logger = logging.getLogger(__name__)

EPOCH_LINE = re.compile(r"^\S+ lr \S+ seed \S+ epoch \d+/\d+ train loss ")
REUSED_LINE = re.compile(r"^\S+ lr \S+ seed \S+: done before ")


def latest_checkpoint(plan: Plan, run: Run):
    """The run's latest checkpoint folder, None when it has none."""
    from tupe_ds.export.write import find_checkpoint

    try:
        return find_checkpoint(plan.run_dir(run))[1]
    except ExportError:
        return None


def export_for(plan: Plan, run: Run) -> str:
    """OUT/exports/NAME: the run's latest checkpoint through tupe-export, redone only when the
    run has a newer checkpoint; one process exports at a time (Slurm array tasks share it)."""
    from tupe_ds.export.write import export

    exported = plan.export_dir(run)
    os.makedirs(os.path.dirname(exported), exist_ok=True)
    with locked(exported + ".lock"):
        if exported_source(exported) != latest_checkpoint(plan, run):
            export(plan.run_dir(run), exported)
    return exported


def exported_source(exported: str):
    try:
        return read_export_description(exported).get("source")
    except ExportError:
        return None


def finetune_args(plan: Plan, run: Run, task: str):
    """tupe-finetune's flags of a fine-tune, parsed, its global batch resolved for the plan's
    processes."""
    args = tupe_finetune.parser().parse_args(plan.finetune_argv(run, task))
    args.global_batch_size = global_batch_size(args, plan.processes)
    return args


def is_finished(plan: Plan, run: Run, task: str) -> bool:
    """The task's TASK.json holds the plan's grid, fine-tuned from the run's latest checkpoint
    under the plan's settings."""
    source = exported_source(plan.export_dir(run))
    if source is None or source != latest_checkpoint(plan, run):
        return False
    args = finetune_args(plan, run, task)
    settings = finetune_settings(args, TASKS[task], source, tupe_finetune.parse_valid(args.valid))
    return finished(args.out, task, settings, args.lr, args.seeds)


def status_name(run: Run, task: str) -> str:
    return f"{run.name}/{task}"


def state(plan: Plan, run: Run, task: str, status: dict) -> str:
    """complete, failed (exit N), or not done (not started, stopped, or of an older checkpoint)."""
    if is_finished(plan, run, task):
        return "complete"
    attempt = status.get(status_name(run, task))
    return f"failed (exit {attempt['exit']})" if attempt and attempt["exit"] else "not done"


def finetune_run(plan: Plan, run: Run, launcher: str, position: str) -> dict:
    """Exports the (complete) run and fine-tunes it on every task not finished; {"NAME/TASK":
    exit code} of those started."""
    try:
        export_for(plan, run)
    except ExportError as error:
        log = os.path.join(plan.out, "logs", f"{run.name}.export.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "a") as f:
            f.write(f"tupe-export: error: {error}\n")
        record_status(plan.out, f"{run.name}/export", 1, log)
        logger.error(f"{position} {run.name}: FAILED to export ({error}); its fine-tunes are not "
                     "started; going on with the others")
        return {f"{run.name}/export": 1}
    exits = {}
    for task in plan.tasks:
        name = status_name(run, task)
        if is_finished(plan, run, task):
            logger.info(f"{position} {name}: fine-tuned before, not started again")
            continue
        argv = plan.finetune_argv(run, task)
        args = finetune_args(plan, run, task)
        epochs = args.epochs or TASKS[task].epochs

        def epochs_done(line: str, done: int):
            if EPOCH_LINE.match(line):
                return done + 1
            return done + epochs if REUSED_LINE.match(line) else None

        exits[name] = launched(
            plan.out, name, os.path.join(plan.out, "logs", f"{run.name}.{task}.log"),
            lambda port: launcher_command(launcher, plan.processes, "tupe_ds.finetune.run", argv,
                                          port), epochs_done, position,
            total=len(args.lr) * len(args.seeds) * epochs, unit="epoch")
    return exits


def finetune_flags(plan: Plan, run: Run, task: str) -> list:
    """tupe-finetune's flags for a fine-tune of the plan (a Slurm array task), after its run is
    exported; CompareError when the run is not complete or its export fails."""
    steps = plan.trained_steps(run)
    if steps < plan.steps:
        raise CompareError(f"{run.name} has {steps} of {plan.steps} steps: not fine-tuned on "
                           f"{task}; submit the comparison again to finish it")
    try:
        export_for(plan, run)
    except ExportError as error:
        raise CompareError(f"{run.name}: the export failed: {error}") from None
    return plan.finetune_argv(run, task)


def finetunes_of(plan: Plan) -> tuple:
    """{encoding: {pretraining seed: {task: TASK.json}}} of the finished fine-tunes, and
    {"NAME/TASK": state} of every fine-tune."""
    found, states = {}, {}
    status = read_status(plan.out)
    for run, task in plan.finetunes:
        states[status_name(run, task)] = state(plan, run, task, status)
        if states[status_name(run, task)] == "complete":
            with open(os.path.join(plan.finetune_dir(run), f"{task}.json")) as f:
                found.setdefault(run.encoding, {}).setdefault(run.seed, {})[task] = json.load(f)
    return found, states
