"""A one-node Slurm cluster on 127.0.0.1 for the tests: munged, slurmctld and slurmd from Debian's
packages (installed when missing, as root), configured in a temporary folder, stopped by PID.

Cgroups are not available on this kind of machine: processes are tracked by proctrack/linuxproc
and tasks are not confined (task/none).
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "openmpi-bin"]
PROGRAMS = ["sbatch", "scontrol", "slurmctld", "slurmd", "munged", "mpirun"]


def which(program: str) -> Optional[str]:
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")


def install_packages() -> Optional[str]:
    """None when Slurm, munge and OpenMPI are there (installing them if needed); else why not."""
    missing = [p for p in PROGRAMS if which(p) is None]
    if not missing:
        return None
    if os.geteuid() != 0 or which("apt-get") is None:
        return f"{', '.join(missing)} missing, and apt-get as root is not available to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            return f"`{' '.join(command)}` failed: {result.stderr.strip()[-500:]}"
    missing = [p for p in PROGRAMS if which(p) is None]
    return f"{', '.join(missing)} still missing after apt-get install" if missing else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) // 1024


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        for name in ("state", "spool", "munge"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.pid_files = []
        munge = root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.socket"
        self._start([which("munged"), f"--key-file={key}", f"--socket={socket_path}",
                     f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                     f"--seed-file={munge / 'munge.seed'}", "--force"], munge / "munged.pid")
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=tupe-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb()} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start([which("slurmctld"), "-f", str(self.conf)], root / "slurmctld.pid")
        self._start([which("slurmd"), "-f", str(self.conf)], root / "slurmd.pid")
        deadline = time.time() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%T", check=False).stdout:
            if time.time() > deadline:
                raise RuntimeError("the Slurm node did not come up:\n" + self.logs())
            time.sleep(0.5)

    def _start(self, command, pid_file: Path) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=60)
        self.pid_files.append(pid_file)
        deadline = time.time() + 30
        while not pid_file.exists():
            if time.time() > deadline:
                raise RuntimeError(f"{command[0]} wrote no {pid_file}:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def run(self, *command, check=True, env=None) -> subprocess.CompletedProcess:
        result = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True,
                                text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr}")
        return result

    def sbatch(self, *arguments, env=None) -> str:
        return self.run("sbatch", "--parsable", *arguments, env=env).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job: JobState, Restarts, ExitCode, ..."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait(self, job_id: str, condition, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while True:
            job = self.job(job_id)
            if condition(job):
                return job
            if time.time() > deadline:
                raise AssertionError(f"job {job_id} timed out in state {job.get('JobState')}")
            time.sleep(1)

    def wait_until_done(self, job_id: str, timeout: float = 300) -> dict:
        return self.wait(job_id, lambda job: job["JobState"] in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"), timeout)

    def stop(self) -> None:
        for pid_file in reversed(self.pid_files):  # slurmd, slurmctld, then munged
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                continue
            deadline = time.time() + 20
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
