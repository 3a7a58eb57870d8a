"""`tupe-doctor --slurm`: what the ranks of a job started in this allocation will use, and what
will go wrong on a real cluster, each with what to change.

Run it inside the allocation (in the batch script, or in `salloc`), with the job's --data and
--out. It reads Slurm's variables only (no scontrol, which containers often lack) and the mount
table of this node.
"""

from typing import List, Optional

from tupe_ds.distributed.launch import SRUN_PORTS, first_host, srun_port
from tupe_ds.machine.extension_locks import SHARED_FILESYSTEMS, extensions_root, filesystem_type
from tupe_ds.machine.findings import Finding

NETWORK_VARIABLES = ("NCCL_", "GLOO_", "UCX_", "FI_")  # prefixes of the interface settings


def slurm_report(environ, backend: str, data: Optional[str], out: Optional[str],
                 mounts: str = "/proc/mounts") -> tuple:
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
    lines = [f"nodes: {nodes} ({nodelist}); tasks: {environ.get('SLURM_NTASKS', '?')} "
             f"({environ.get('SLURM_NTASKS_PER_NODE', '?')} per node)",
             f"CPUs per task: {cpus or 'not set'} (the step gets {step_cpus or 'one'} through "
             "slurm/srun_requeue.sh)",
             f"rendezvous: {address}:{port}; backend {backend}",
             "network: " + (", ".join(f"{k}={v}" for k, v in sorted(environ.items())
                                      if k.startswith(NETWORK_VARIABLES)) or "no NCCL_/GLOO_ "
                            "variable set (interfaces chosen from the hostname)"),
             f"torch extensions: {extensions} ({filesystem_type(extensions, mounts) or '?'})"]
    found: List = []
    if not step_cpus:
        found.append(Finding(False, "no --cpus-per-task in this job: where Slurm binds tasks to "
                                    "CPUs (task/affinity, task/cgroup) each task gets one core "
                                    "for the training loop, the batch-making thread and torch's "
                                    "threads; add #SBATCH --cpus-per-task (the shipped scripts "
                                    "ask for 8)"))
    if port >= SRUN_PORTS[1]:
        found.append(Finding(False, f"MASTER_PORT={port} is in Linux's ephemeral range (32768 and "
                                    "up), where another process may hold it; choose one from "
                                    f"{SRUN_PORTS[0]} to {SRUN_PORTS[1] - 1}"))
    kind = filesystem_type(extensions, mounts)
    if nodes > 1 and kind in SHARED_FILESYSTEMS:
        found.append(Finding(False, f"torch extensions are built in {extensions}, on a {kind} "
                                    "filesystem every node shares: a build's lock on one node is "
                                    "invisible to the others; the Slurm scripts use a node-local "
                                    "folder unless TORCH_EXTENSIONS_DIR is set (unset it)"))
    for flag, folder, fatal in (("--out", out, True), ("--data", data, False)):
        if folder is None:
            continue
        lines.append(f"{flag} {folder}: {filesystem_type(folder, mounts) or '?'}")
        kind = filesystem_type(folder, mounts)
        if nodes > 1 and kind not in SHARED_FILESYSTEMS:
            found.append(Finding(fatal, f"{flag} {folder} is on a filesystem of this node "
                                        f"({kind or 'unknown'}), which other nodes do not see"
                                        + (": every rank writes its checkpoint files there; put "
                                           "it on a filesystem all nodes mount" if fatal else
                                           ": every node needs the same copy there; put it on a "
                                           "shared filesystem or copy it to each node")))
    return lines, found
