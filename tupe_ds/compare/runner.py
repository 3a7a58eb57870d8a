"""The runs of a comparison, one after the other on this machine, each under a launcher
(deepspeed or torchrun) as `tupe-pretrain` would be started by hand.

A run whose latest checkpoint is at --steps is done and not started again; any other is started
with the same flags, which resumes it from its latest checkpoint. A failed run is recorded in
OUT/status.json and the next one starts. Each run's output goes to OUT/logs/NAME.log (appended).
"""

import json
import os
import re
import socket
import subprocess
import sys

from tqdm import tqdm

from tupe_ds.compare.plan import Plan, Run
from tupe_ds.files import write_atomically
from tupe_ds.train.checkpoint import latest_step

LAUNCHERS = ("deepspeed", "torchrun")
STATUS_FILE = "status.json"
STEP_LINE = re.compile(r"^step (\d+) loss ")
RESUMED_LINE = re.compile(r"^resumed at step (\d+) of ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(plan: Plan, run: Run, launcher: str) -> list:
    """The launcher's command line for one run, on a free port of this machine."""
    port = str(free_port())
    if launcher == "deepspeed":
        prefix = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
                  str(plan.processes), "--master_port", port, "--module"]
    else:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                  str(plan.processes), "--master_port", port, "-m"]
    return [*prefix, "tupe_ds.pretrain", *plan.pretrain_argv(run)]


def trained_steps(plan: Plan, run: Run) -> int:
    return latest_step(os.path.join(plan.run_dir(run), "checkpoints"))


def read_status(out: str) -> dict:
    """{run name: {"exit": code, "log": path}} of each run's last attempt."""
    path = os.path.join(out, STATUS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record_status(out: str, name: str, exit_code: int, log: str) -> None:
    status = read_status(out)
    status[name] = {"exit": exit_code, "log": log}
    write_atomically(os.path.join(out, STATUS_FILE), json.dumps(status, indent=1))


def train_run(plan: Plan, run: Run, launcher: str, position: str) -> int:
    """One run under the launcher, its output appended to OUT/logs/NAME.log and shown as a
    progress bar over the steps; the launcher's exit code."""
    log = os.path.join(plan.out, "logs", f"{run.name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    command = launch_command(plan, run, launcher)
    bar = tqdm(total=plan.steps, initial=trained_steps(plan, run), unit="step",
               desc=f"{position} {run.name}", file=sys.stdout, dynamic_ncols=True)
    with open(log, "a") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        for line in process.stdout:
            f.write(line)
            f.flush()
            step = STEP_LINE.match(line) or RESUMED_LINE.match(line)
            if step:
                bar.update(int(step.group(1)) - bar.n)
        exit_code = process.wait()
    bar.close()
    record_status(plan.out, run.name, exit_code, log)
    return exit_code


def run_all(plan: Plan, launcher: str) -> dict:
    """Trains every run that has not reached --steps; {run name: exit code} of those started."""
    exits = {}
    runs = plan.runs
    for index, run in enumerate(runs, 1):
        position = f"[{index}/{len(runs)}]"
        done = trained_steps(plan, run)
        if done >= plan.steps:
            print(f"{position} {run.name}: done ({done} steps), not started again", flush=True)
            continue
        exits[run.name] = train_run(plan, run, launcher, position)
        if exits[run.name]:
            print(f"{position} {run.name}: FAILED with exit code {exits[run.name]}; see "
                  f"{os.path.join(plan.out, 'logs', run.name + '.log')}; going on with the others",
                  flush=True)
    return exits
