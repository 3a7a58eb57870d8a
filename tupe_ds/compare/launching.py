"""Following a comparison's processes on this machine (started by
tupe_ds/distributed/launchers.py): their output appended to a log and followed by a progress bar,
and the exit code of each attempt kept in OUT/status.json."""

import json
import logging
import os
import subprocess
import sys

from tqdm import tqdm

from tupe_ds.distributed.launchers import on_a_free_port
from tupe_ds.tools.files import locked, write_atomically

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def launched(out: str, name: str, log: str, command, progress, where: str, **bar) -> int:
    """`command(port)` on a free port, followed (`follow`, `progress` its position) under a tqdm
    bar of `bar`'s settings named `where` `name`; its exit code recorded under `name` in
    OUT/status.json, and said where it failed (the next one starts all the same)."""
    bar = tqdm(desc=f"{where} {name}", file=sys.stdout, dynamic_ncols=True, **bar)
    exit_code = on_a_free_port(lambda port: follow(command(port), log, bar, progress))
    bar.close()
    record_status(out, name, exit_code, log)
    if exit_code:
        logger.error(f"{where} {name}: FAILED with exit code {exit_code}; see {log}; going on "
                     "with the others")
    return exit_code


def follow(command: list, log: str, bar, position) -> int:
    """Runs `command`, its output appended to `log`; `position(line, bar.n)` (a number or None)
    moves the tqdm `bar`. The exit code."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "a") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        for line in process.stdout:
            f.write(line)
            f.flush()
            reached = position(line, bar.n)
            if reached is not None:
                bar.update(reached - bar.n)
        return process.wait()


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
