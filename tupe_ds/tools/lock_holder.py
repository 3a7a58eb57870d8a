"""Who holds a lock: the holder's record, read back, described, and judged alive or gone.

The record (host, boot, PID namespace, PID and its start time, Slurm job, step and restart count,
when it started) is what a lock file of tupe_ds/tools/lock.py holds; `gone_because` states the
rules by which its holder is gone and its lock taken over (listed in lock.py's docstring).
"""

import datetime
import json
import os
import socket
import uuid
from typing import Optional

from tupe_ds.tools import settings

LEASE_SECONDS = settings.seconds("TUPE_DS_LOCK_LEASE_SECONDS", 600.0, least=10)  # renewed every tenth
SLURM_FIELDS = {"slurm_job_id": "SLURM_JOB_ID", "slurm_step_id": "SLURM_STEP_ID",
                "slurm_restart_count": "SLURM_RESTART_COUNT"}


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot), None when there is no such process:
    a PID reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"): containers on one host share its name
    and boot, not their PIDs."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_holder() -> dict:
    pid = os.getpid()
    holder = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "boot_id": boot_id(),
              "pid_namespace": pid_namespace(), "pid": pid, "pid_start": process_start(pid),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds")}
    holder.update({field: os.environ[name] for field, name in SLURM_FIELDS.items()
                   if name in os.environ})
    return holder


REQUIRED_FIELDS = {"token": str, "host": str, "pid": int}
OPTIONAL_FIELDS = {"boot_id": str, "pid_namespace": str, "pid_start": int, "started": str,
                   **{field: str for field in SLURM_FIELDS}}
MAX_PID = 2 ** 22  # Linux's largest pid_max: 0 and negative PIDs would name process groups


def parse_holder(data: bytes) -> Optional[dict]:
    """The holder a lock file's bytes name; None when they are no lock record (damaged): not a
    JSON object, a field of this module's records of another type (`pid` a bool or a string) or
    a PID that names no single process (0 or less would ask the kernel about process groups,
    and so always count as alive)."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    for field, kind in {**REQUIRED_FIELDS, **OPTIONAL_FIELDS}.items():
        value = record.get(field)
        if type(value) is not kind and not (value is None and field in OPTIONAL_FIELDS):
            return None
    return record if 0 < record["pid"] <= MAX_PID else None


def describe(holder: dict) -> str:
    slurm = holder.get("slurm_job_id")
    job = f", Slurm job {slurm}" if slurm else ""
    step = holder.get("slurm_step_id")
    if job and step:
        job += f" step {step}"
    return (f"process {holder['pid']} on {holder['host']}{job}, started "
            f"{holder.get('started') or 'at an unknown time'}")


def same_machine(holder: dict) -> bool:
    """Whether the holder's PID means a process here: the same host, boot and PID namespace."""
    return (holder["host"] == socket.gethostname() and holder.get("boot_id") == boot_id()
            and holder.get("pid_namespace") == pid_namespace())


def alive_here(holder: dict) -> bool:
    """Whether the holder is a live process of this machine (its PID, with its start time)."""
    if not same_machine(holder):
        return False
    started = process_start(holder["pid"])
    if started is None:  # no such process, or /proc hides it (hidepid): ask the kernel
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return process_start(holder["pid"]) is None  # alive, but its start time unreadable
    return started == holder.get("pid_start", started)


def restarts(count) -> int:
    """SLURM_RESTART_COUNT as recorded (absent before a job's first requeue: 0)."""
    try:
        return int(count or 0)
    except (TypeError, ValueError):
        return 0


def gone_because(holder: Optional[dict], lease_age: float) -> Optional[str]:
    """Why the holder of a lock is gone; None when it may be alive. `lease_age`: seconds since
    its last renewal, on the filesystem's clock and never negative (lock_file.lease_age)."""
    if holder is None:
        return "the lock file is damaged (not a lock record)"
    if same_machine(holder):
        if not alive_here(holder):
            return "its process has ended"
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if job is not None and holder.get("slurm_job_id") == job and \
            restarts(holder.get("slurm_restart_count")) < restarts(
                os.environ.get("SLURM_RESTART_COUNT")):
        return f"it is this Slurm job ({job}) before it was requeued"
    if lease_age > LEASE_SECONDS:
        return f"its lease was not renewed for {lease_age:.0f} s (its node is lost)"
    return None
