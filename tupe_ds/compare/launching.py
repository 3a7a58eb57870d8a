"""Starting a comparison's processes on this machine: a module under a launcher (deepspeed or
torchrun) on a free port, its output appended to a log and followed by a progress bar, and the
exit code of each attempt kept in OUT/status.json."""

import json
import os
import socket
import subprocess
import sys

from tupe_ds.tools.files import locked, write_atomically

LAUNCHERS = ("deepspeed", "torchrun")
STATUS_FILE = "status.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command(launcher: str, processes: int, module: str, argv: list) -> list:
    """`python -m MODULE ARGV` in `processes` processes of this machine, as started by hand."""
    port = str(free_port())
    if launcher == "deepspeed":
        prefix = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(processes),
                  "--master_port", port, "--module"]
    else:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                  str(processes), "--master_port", port, "-m"]
    return [*prefix, module, *argv]


def follow(command: list, log: str, bar, position) -> int:
    """Runs `command`, its output appended to `log`; `position(line)` (a number or None) moves
    the tqdm `bar`. The exit code."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "a") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        for line in process.stdout:
            f.write(line)
            f.flush()
            reached = position(line)
            if reached is not None:
                bar.update(reached - bar.n)
        exit_code = process.wait()
    bar.close()
    return exit_code


def read_status(out: str) -> dict:
    """{name: {"exit": code, "log": path}} of each run's and fine-tune's last attempt."""
    path = os.path.join(out, STATUS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record_status(out: str, name: str, exit_code: int, log: str) -> None:
    """Under a lock: Slurm array tasks record theirs at the same time."""
    path = os.path.join(out, STATUS_FILE)
    with locked(path + ".lock"):
        status = read_status(out)
        status[name] = {"exit": exit_code, "log": log}
        write_atomically(path, json.dumps(status, indent=1))
