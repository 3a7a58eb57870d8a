"""`tupe-doctor --slurm`: what the ranks of a job started in this allocation will use, and what
will go wrong on a real cluster, each with what to change.

Run it inside the allocation (in the batch script, or in `salloc`), with the job's --data and
--out. It reads Slurm's variables only (no scontrol, which containers often lack), the mount
table and the ephemeral port range of this node, and tries the locks a run takes in --out and
--data.
"""

import os
from dataclasses import dataclass
from typing import List, Optional

from tupe_ds.distributed.launch import first_host, srun_port
from tupe_ds.distributed.launchers import PORT_RANGE_FILE, ephemeral_ports
from tupe_ds.machine.extension_locks import (LOCAL_FILESYSTEMS, SHARED_FILESYSTEMS,
                                             extensions_root, filesystem_type)
from tupe_ds.tools.lock import HOLDER_SUFFIX, lock_support

NETWORK_VARIABLES = ("NCCL_", "GLOO_", "UCX_", "FI_")  # prefixes of the interface settings


@dataclass(frozen=True)
class Finding:
    """What a check of the machine found: tupe-doctor's and the Slurm check's findings."""
    fatal: bool  # the run would fail; else a warning
    text: str  # what is wrong and what to change


def slurm_report(environ, backend: str, data: Optional[str], out: Optional[str],
                 mounts: str = "/proc/mounts", port_range: str = PORT_RANGE_FILE) -> tuple:
    """(lines describing what the ranks will use, findings [(fatal, text)]) for the allocation
    `environ` describes."""
    if "SLURM_JOB_ID" not in environ:
        return [], [Finding(True, "--slurm: no Slurm allocation here (SLURM_JOB_ID is not set); "
                                  "run it in the batch script or under salloc")]
    nodes = int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    nodelist = environ.get("SLURM_JOB_NODELIST", "?")
    cpus = environ.get("SLURM_CPUS_PER_TASK")
    step_cpus = environ.get("SRUN_CPUS_PER_TASK") or cpus  # slurm/srun_requeue.sh passes it on
    address = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist != "?" else "?")
    port = int(environ.get("MASTER_PORT") or srun_port(int(environ["SLURM_JOB_ID"])))
    extensions = extensions_root(environ)
    kind = filesystem_type(extensions, mounts)
    lines = [f"nodes: {nodes} ({nodelist}); tasks: {environ.get('SLURM_NTASKS', '?')} "
             f"({environ.get('SLURM_NTASKS_PER_NODE', '?')} per node)",
             f"CPUs per task: {cpus or 'not set'} (the step gets {step_cpus or 'one'} through "
             "slurm/srun_requeue.sh)",
             f"rendezvous: {address}:{port}; backend {backend}",
             "network: " + (", ".join(f"{k}={v}" for k, v in sorted(environ.items())
                                      if k.startswith(NETWORK_VARIABLES)) or "no NCCL_/GLOO_ "
                            "variable set (interfaces chosen from the hostname)"),
             f"torch extensions: {extensions} ({kind or '?'})"]
    found: List = []
    if not step_cpus:
        found.append(Finding(False, "no --cpus-per-task in this job: where Slurm binds tasks to "
                                    "CPUs (task/affinity, task/cgroup) each task gets one core "
                                    "for the training loop, the batch-making thread and torch's "
                                    "threads; add #SBATCH --cpus-per-task (the shipped scripts "
                                    "ask for 8)"))
    first, last = ephemeral_ports(port_range)
    if first <= port <= last:
        found.append(Finding(False, f"MASTER_PORT={port} is in this node's ephemeral port range "
                                    f"({first}-{last}, {port_range}), where another process may "
                                    f"hold it; set MASTER_PORT to a free port below {first}"))
    if nodes > 1 and kind in SHARED_FILESYSTEMS:
        found.append(Finding(False, f"torch extensions are built in {extensions}, on a {kind} "
                                    "filesystem every node shares: a build's lock on one node is "
                                    "invisible to the others; the Slurm scripts use a node-local "
                                    "folder unless TORCH_EXTENSIONS_DIR is set (unset it)"))
    for flag, folder, fatal in (("--out", out, True), ("--data", data, False)):
        if folder is None:
            continue
        kind = filesystem_type(folder, mounts)
        locks, problem = lock_report(folder, run_lock=flag == "--out")
        lines.append(f"{flag} {folder}: {kind or '?'}; {locks}")
        if problem:
            found.append(Finding(True, f"{flag} {folder}: {problem}"))
        if nodes > 1 and kind in LOCAL_FILESYSTEMS:
            found.append(Finding(fatal, f"{flag} {folder} is on a filesystem of this node "
                                        f"({kind}), which other nodes do not see"
                                        + (": every rank writes its checkpoint files there; put "
                                           "it on a filesystem all nodes mount" if fatal else
                                           ": every node needs the same copy there; put it on a "
                                           "shared filesystem or copy it to each node")))
        elif nodes > 1 and kind not in SHARED_FILESYSTEMS:
            found.append(Finding(False, f"{flag} {folder} is on a filesystem tupe-doctor does not "
                                        f"know ({kind or 'unknown'}): make sure every node mounts "
                                        "it at this path"))
    return lines, found


def lock_report(folder: str, run_lock: bool) -> tuple:
    """(which lock the index cache takes in `folder`, the problem when a lock the run needs
    there cannot be taken): tried in the folder, or the nearest one above it that exists (--out
    before the run makes it). The index cache's lock is `flock`, else a lock file made by a hard
    link (tupe_ds/tools/lock.py); OUT/run.lock (`run_lock`) is always a hard link."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK):
        return f"locks: not tried ({existing} is not writable here)", None
    try:
        flock, link = lock_support(existing)
    except OSError as error:
        return f"locks: not tried ({error})", None
    locks = ("locks: flock" if flock is None else
             f"locks: lock files (NAME.lock{HOLDER_SUFFIX}, as flock fails here: {flock})"
             if link is None else "locks: none")
    problems = []
    if link is not None and run_lock:
        problems.append(f"hard links fail here ({link}), and OUT/run.lock is made by one: put "
                        "--out on another filesystem")
    if link is not None and flock is not None:
        problems.append(f"neither flock ({flock}) nor hard links ({link}) work here, so the "
                        "index cache cannot lock: give --index-cache a folder on another "
                        "filesystem")
    return locks, "; ".join(problems) or None
