"""The runs of a comparison, one after the other on this machine, each under a launcher
(deepspeed or torchrun) as `tupe-pretrain` would be started by hand, and, when the plan
fine-tunes, each complete run's fine-tunes right after it (finetuning.py).

A run whose latest checkpoint is at --steps is done and not started again; any other is started
with the same flags, which resumes it from its latest checkpoint. A failed run is recorded in
OUT/status.json and the next one starts. Each run's output goes to OUT/logs/NAME.log (appended).
"""

import logging
import os
import re

from tupe_ds.compare.finetuning import finetune_run
from tupe_ds.compare.launching import launched
from tupe_ds.compare.plan import Plan, Run
from tupe_ds.distributed.launchers import launcher_command

logger = logging.getLogger(__name__)

STEP_LINE = re.compile(r"^step +(\d+)/\d+ \| loss ")  # train/progress.py's line
RESUMED_LINE = re.compile(r"^resumed at step (\d+) of ")


def launch_command(plan: Plan, run: Run, launcher: str, port: int) -> list:
    """The launcher's command line for one run, on `port`."""
    return launcher_command(launcher, plan.processes, "tupe_ds.pretrain", plan.pretrain_argv(run),
                            port)


def steps_logged(line: str, done: int):
    step = STEP_LINE.match(line) or RESUMED_LINE.match(line)
    return int(step.group(1)) if step else None


def run_all(plan: Plan, launcher: str) -> dict:
    """Trains every run that has not reached --steps, and fine-tunes every complete one on the
    tasks it is not fine-tuned on; {run name or NAME/TASK: exit code} of those started."""
    exits = {}
    runs = plan.runs
    for index, run in enumerate(runs, 1):
        position = f"[{index}/{len(runs)}]"
        done = plan.trained_steps(run)
        if done >= plan.steps:
            logger.info(f"{position} {run.name}: done ({done} steps), not started again")
        else:
            exits[run.name] = launched(
                plan.out, run.name, os.path.join(plan.out, "logs", f"{run.name}.log"),
                lambda port: launch_command(plan, run, launcher, port), steps_logged, position,
                total=plan.steps, initial=done, unit="step")
        if plan.tasks and plan.trained_steps(run) >= plan.steps:
            exits.update(finetune_run(plan, run, launcher, position))
    return exits
