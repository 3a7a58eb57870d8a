"""Slurm clusters for the tests: munged, slurmctld and slurmd from Debian's packages (installed
when missing, as root), configured in a temporary folder, stopped by PID.

- SlurmCluster(root): one node on 127.0.0.1.
- SlurmCluster(root, Network(...)): a controller and nodes n1, n2, ... each in a network
  namespace of its own, joined by a bridge (Network): real sockets between the nodes, one
  slurmd per node (`slurmd -N nK`; Debian builds Slurm with --enable-multiple-slurmd). The munge
  socket and the filesystem are the machine's, as a cluster's shared filesystem would be.

Cgroups are not available on this kind of machine: processes are tracked by proctrack/linuxproc
and tasks are not confined (task/none).

What a cluster makes (namespaces, the bridge, veths, daemons) is recorded while its process holds
it (RECORDS). A process that ends before its teardown (SIGKILL; a SIGINT to pytest's controller
alone ends the xdist workers without their fixtures' teardowns; a CI job's timeout) leaves all of
it running, and the next cluster made on the machine removes it first, with a warning that says
what it removed (remove_leftovers).
"""

import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import List, Optional

from tupe_ds.distributed.launch import SRUN_PORTS
from tupe_ds.distributed.launchers import free_port

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


RECORDS = Path("/run/tupe-ds-test-clusters")  # a tmpfs: gone with what it records at a reboot
RECORD = re.compile(r"^(\d+)-(\d+)\.(json|part)$")  # OWNER-START: its owner's PID, start time
RECORDED_AS = {"netns": "namespaces", "link": "links"}
_recording = threading.Lock()


def started(pid: int) -> Optional[str]:
    """When process `pid` started (its /proc stat), which tells it from a later process given the
    same PID; None when no process has it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record(kind: str, name: str, held: bool = True) -> None:
    """Adds `name` to this process's record in RECORDS (not `held`: removes it) as one of `kind`:
    "namespaces" and "links" (made by `ip`), "folders" (a cluster's, which its processes name),
    "trees" (removed whole). Written atomically; the record removed once it holds nothing."""
    path = RECORDS / f"{os.getpid()}-{started(os.getpid())}.json"
    with _recording:
        try:
            entries = json.loads(path.read_text())
        except FileNotFoundError:
            entries = {}
        names = [other for other in entries.get(kind, []) if other != name]
        entries[kind] = names + [name] if held else names
        if not any(entries.values()):
            path.unlink(missing_ok=True)
            return
        RECORDS.mkdir(parents=True, exist_ok=True)
        written = path.with_suffix(".part")
        written.write_text(json.dumps(entries))
        os.replace(written, path)


def remove_leftovers() -> List[str]:
    """Removes what the clusters of each process that ended before its teardown left running:
    the processes that name a cluster's folder (daemons, job steps, tasks) and those in its
    namespaces, its namespaces, links and temporary folders; a warning names them. One sweep at
    a time on the machine. The records removed."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    removed = []
    with open(RECORDS / ".sweeping", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in sorted(RECORDS.iterdir()):
            match = RECORD.match(path.name)
            if not match or started(int(match.group(1))) == match.group(2):
                continue  # not a record, or one its process holds still
            try:
                held = json.loads(path.read_text()) if match.group(3) == "json" else {}
            except (OSError, ValueError):  # a write a kill cut short
                held = {}

            def names(kind: str) -> List[str]:
                listed = held.get(kind, []) if isinstance(held, dict) else []
                return [name for name in listed if isinstance(name, str) and name]

            # a folder that would name half the machine's processes is no cluster's
            for folder in [f for f in names("folders") if len(Path(f).parts) > 3]:
                for pid in naming(folder):
                    kill(pid, signal.SIGKILL)
            for namespace in names("namespaces"):
                for pid in namespace_pids(namespace):
                    kill(pid, signal.SIGKILL)
                subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
            for link in names("links"):
                subprocess.run(["ip", "link", "delete", link], capture_output=True)
            for tree in [t for t in names("trees") if len(Path(t).parts) > 2]:
                shutil.rmtree(tree, ignore_errors=True)
            path.unlink(missing_ok=True)
            if held:
                removed.append(path.name)
                warnings.warn(f"removed what the test clusters of process {match.group(1)}, "
                              f"which ended before their teardown, left: {json.dumps(held)}")
    return removed


def kill(pid: int, signal_number: int) -> None:
    try:
        os.kill(pid, signal_number)
    except ProcessLookupError:
        pass


def naming(folder: str) -> List[int]:
    """The processes whose command line or environment names a path in `folder`: a cluster's
    daemons (their configuration), its job steps and their tasks (SLURM_CONF). slurmctld's
    slurmscriptd names none, and ends with slurmctld."""
    path, found = os.path.join(folder, "").encode(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and any(path in Path("/proc", entry, part).read_bytes()
                                       for part in ("cmdline", "environ")):
                found.append(int(entry))
        except OSError:  # ended meanwhile
            continue
    return found


def namespace_pids(namespace: str) -> List[int]:
    """Every process running in network namespace `namespace`."""
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()]


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) // 1024


class Network:
    """A network of its own for test hosts on this machine: a bridge, and per host a network
    namespace joined to it by a veth pair whose inner end is `eth1`. The addresses are from the
    documentation range 192.0.2.0/24 and exist only inside these namespaces (the bridge has
    none), so no traffic leaves them. Inside host H, the machine's hostname resolves to H's own
    address, as on a cluster node (a hosts file of its own, mounted on /etc/hosts in a private
    mount namespace: `ip netns exec` would also remount /sys, hiding the cgroups slurmd needs).
    Needs root; remove() takes everything down."""

    SUBNET = "192.0.2"
    INTERFACE = "eth1"

    def __init__(self, hosts: dict):
        """hosts: name -> last byte of its address, e.g. {"ctl": 100, "n1": 101}."""
        tag = str(os.getpid())  # no running process's names are another's (15 bytes at most)
        self.bridge = f"tupebr{tag}"
        self.namespaces = {host: f"tupe-{host}-{tag}" for host in hosts}
        self.addresses = {host: f"{self.SUBNET}.{last}" for host, last in hosts.items()}
        self.created = []  # what remove() takes down, newest first
        remove_leftovers()
        self.folder = Path(tempfile.mkdtemp(prefix="tupe-network-"))
        record("trees", str(self.folder))
        try:
            self._make("link", self.bridge, "link", "add", self.bridge, "type", "bridge")
            self._ip("link", "set", self.bridge, "up")
            for index, host in enumerate(hosts):
                self._add_host(host, f"tupev{index}{tag}")
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why network namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for program, package in (("ip", "iproute2"), ("nsenter", "util-linux"),
                                 ("unshare", "util-linux")):
            if which(program) is None:
                return f"no `{program}` command (Debian's {package})"
        probe = f"tupe-probe-{os.getpid()}"
        result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if result.returncode != 0:
            return f"`ip netns add` refused: {result.stderr.strip()}"
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
        return None

    @staticmethod
    def _ip(*arguments) -> None:
        result = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(arguments)}: {result.stderr.strip()}")

    def _make(self, kind: str, name: str, *arguments) -> None:
        """`ip ARGUMENTS`, which makes `name`: recorded first (a kill between the two leaves
        nothing unrecorded), unrecorded if it fails (a name in use is not this network's)."""
        record(RECORDED_AS[kind], name)
        try:
            self._ip(*arguments)
        except BaseException:
            record(RECORDED_AS[kind], name, held=False)
            raise
        self.created.append((kind, name))

    def _add_host(self, host: str, outer: str) -> None:
        namespace = self.namespaces[host]
        self._make("netns", namespace, "netns", "add", namespace)
        self._make("link", outer, "link", "add", outer, "type", "veth", "peer", "name",
                   self.INTERFACE, "netns", namespace)
        self._ip("link", "set", outer, "master", self.bridge, "up")
        self._ip("-n", namespace, "addr", "add", f"{self.addresses[host]}/24", "dev",
                 self.INTERFACE)
        self._ip("-n", namespace, "link", "set", self.INTERFACE, "up")
        self._ip("-n", namespace, "link", "set", "lo", "up")
        names = "".join(f"{address} {name}\n" for name, address in self.addresses.items())
        (self.folder / f"{host}.hosts").write_text(
            f"127.0.0.1 localhost\n{self.addresses[host]} {socket.gethostname()}\n{names}")

    def prefix(self, host: str) -> list:
        """The command prefix that runs a program on `host`."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[host]}", "unshare", "--mount",
                "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                str(self.folder / f"{host}.hosts")]

    def pids(self, host: str) -> List[int]:
        """Every process running in `host`'s namespace."""
        return namespace_pids(self.namespaces[host])

    def remove(self) -> None:
        for kind, name in reversed(self.created):
            if kind == "netns":
                for pid in namespace_pids(name):  # what a failed test left running there
                    kill(pid, signal.SIGKILL)
            subprocess.run(["ip", kind, "delete", name], capture_output=True)
            record(RECORDED_AS[kind], name, held=False)
        self.created = []
        shutil.rmtree(self.folder, ignore_errors=True)
        record("trees", str(self.folder), held=False)


def daemon_port() -> int:
    """A free port for slurmctld or slurmd, below the ports that jobs' rendezvous take
    (launch.srun_port: SRUN_PORTS from the job id), so that a daemon never holds a job's."""
    return free_port(random.randrange(SRUN_PORTS[0] // 2, SRUN_PORTS[0] - 100))


class SlurmCluster:
    def __init__(self, root: Path, network: Optional[Network] = None,
                 task_plugin: str = "task/none"):
        """One node on 127.0.0.1; or, with a network of hosts "ctl" and "n1", "n2", ...,
        slurmctld on ctl and one slurmd per node. `task_plugin` task/affinity binds each task
        to its CPUs, as clusters do."""
        self.root = root
        self.network = network
        self.task_plugin = task_plugin
        self.node = socket.gethostname().split(".")[0]
        for name in ("state", "spool", "munge"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.pid_files = []
        remove_leftovers()
        record("folders", os.path.abspath(root))
        try:
            self._start_daemons()
        except BaseException:
            self.stop()
            raise

    def _start_daemons(self) -> None:
        root, network = self.root, self.network
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
SlurmctldHost={self.node}({network.addresses["ctl"] if network else "127.0.0.1"})
SlurmctldPort={daemon_port()}
SlurmdPort={daemon_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin={self.task_plugin}
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd'}.%n.pid
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd'}.%n.log
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{self._node_lines()}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start([which("slurmctld"), "-f", str(self.conf)], root / "slurmctld.pid",
                    host="ctl")
        for node in self.nodes:
            (root / "spool" / node).mkdir(exist_ok=True)
            extra = ["-N", node] if network else []
            self._start([which("slurmd"), "-f", str(self.conf), *extra],
                        root / f"slurmd.{node}.pid", host=node)
        deadline = time.time() + 60
        while self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split() != [
                "idle"] * len(self.nodes):
            if time.time() > deadline:
                raise RuntimeError("the Slurm nodes did not come up:\n" + self.logs())
            time.sleep(0.5)

    @property
    def nodes(self) -> list:
        if self.network is None:
            return [self.node]
        return [host for host in self.network.addresses if host != "ctl"]

    def _node_lines(self) -> str:
        if self.network is None:
            return (f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} "
                    f"RealMemory={memory_mb()} State=UNKNOWN")
        # Two task slots per node whatever this machine has (config_overrides).
        return "\n".join(f"NodeName={node} NodeAddr={self.network.addresses[node]} CPUs=2 "
                         f"RealMemory={memory_mb() // 4} State=UNKNOWN" for node in self.nodes)

    def on(self, host: Optional[str]) -> list:
        """The prefix that runs a command on `host` ("ctl" or a node; None: this machine)."""
        return self.network.prefix(host) if self.network and host else []

    def _start(self, command, pid_file: Path, host: Optional[str] = None) -> None:
        subprocess.run([*self.on(host), *command], check=True, capture_output=True, timeout=60)
        self.pid_files.append(pid_file)
        deadline = time.time() + 30
        while not daemon_pid(pid_file):
            if time.time() > deadline:
                raise RuntimeError(f"{command[0]} wrote no {pid_file}:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def run(self, *command, check=True, env=None) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, ...), run where the controller is."""
        result = subprocess.run([*self.on("ctl"), *command], env={**self.env, **(env or {})},
                                capture_output=True, text=True, timeout=60)
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

    def start_requeued(self, job_id: str, timeout: float = 120) -> None:
        """Starts a requeued job (pending for Slurm's requeue delay) now. slurmd revokes the
        credential of a job's last run as it ends, to the second: a run started in that same
        second is killed ("Job credential revoked") and the job FAILS, which a loaded machine
        makes likely. So the job starts 2 s after every node has finished its last run."""
        deadline = time.time() + timeout
        while any(busy in state for state in self._node_states()
                  for busy in ("ALLOCATED", "MIXED", "COMPLETING")):
            if time.time() > deadline:
                raise AssertionError(f"the nodes stayed busy: {self._node_states()}")
            time.sleep(0.5)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+2")

    def _node_states(self) -> list:
        lines = self.run("scontrol", "show", "node", "-o").stdout.splitlines()
        return [field.split("=", 1)[1] for line in lines
                for field in line.split() if field.startswith("State=")]

    def wait_until_done(self, job_id: str, timeout: float = 300) -> dict:
        return self.wait(job_id, lambda job: job["JobState"] in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"), timeout)

    def stop(self) -> None:
        """SIGTERM to the Slurm daemons at once, then to munged once they are gone."""
        munged, daemons = [], []
        for pid_file in self.pid_files:
            if pid := daemon_pid(pid_file):
                (munged if pid_file.name == "munged.pid" else daemons).append(pid)
        for group in (daemons, munged):
            for pid in group:
                kill(pid, signal.SIGTERM)
            deadline = time.time() + 20
            while time.time() < deadline and any(running(pid) for pid in group):
                time.sleep(0.1)
        if not any(running(pid) for pid in daemons + munged):  # else the next cluster's to end
            record("folders", os.path.abspath(self.root), held=False)


def daemon_pid(pid_file: Path) -> Optional[int]:
    """The PID a daemon wrote in `pid_file`; None before it has."""
    try:
        return int(pid_file.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
