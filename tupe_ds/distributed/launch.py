"""Which rank this process is, whatever started it, before any process group or check starts.

- the deepspeed launcher and torchrun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT:
  kept as they are;
- srun (a task of a Slurm job step): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the
  first node of the step (read from SLURM_STEP_NODELIST in Python: no scontrol, which container
  runtimes such as pyxis/enroot and Apptainer often lack), port 20000 + job id mod 12768 (below
  Linux's ephemeral ports, 32768 and up, which any process may hold) unless MASTER_ADDR /
  MASTER_PORT are set;
- mpirun (OpenMPI's OMPI_COMM_WORLD_*, or PMI_* of MPICH and Intel MPI): the master is rank 0,
  its address sent to every rank through mpi4py: 127.0.0.1 when all ranks share one host, else
  the address of the interface named by GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME, else the first
  of `hostname -I` (DeepSpeed's choice), unless MASTER_ADDR is set; port MASTER_PORT or 29500,
  which rank 0 checks free first (check_default_port);
- none of them: one process, whose group needs no address (parallel.start_distributed).

Written here because DeepSpeed's own discovery knows mpirun but not srun, and under mpirun takes
the first address of `hostname -I`, whichever interface that is.
"""

import fcntl
import os
import re
import socket
import struct
import subprocess
from typing import MutableMapping

from tupe_ds.tools.errors import CommandRefused

DEFAULT_PORT = 29500
SRUN_PORTS = (20000, 32768)  # [first, end): a port per job, below the ephemeral range


def discover(environ: MutableMapping[str, str] = os.environ) -> str:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in `environ` from the
    launcher's variables; returns the launcher's name. CommandRefused where they are no ranks
    (RANK or WORLD_SIZE not a whole number, RANK not below WORLD_SIZE, LOCAL_RANK not a number)
    or a launcher's are missing."""
    try:
        launcher = launcher_variables(environ)
    except (KeyError, ValueError) as error:  # a launcher's variable missing, or a port no number
        raise CommandRefused(
            f"the launcher's variables in the environment are incomplete ({error}): start the "
            "command through the launcher that sets them all, or unset them to run one "
            "process") from None
    given = {name: environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
             if name in environ}
    wrong = [f"{name}={value!r}" for name, value in given.items()
             if not re.fullmatch("-?[0-9]+" if name == "LOCAL_RANK" else "[0-9]+", value)]
    if not wrong and int(given.get("RANK", "0")) >= int(given.get("WORLD_SIZE", "1")):
        wrong = [f"RANK={given.get('RANK', '0')} with WORLD_SIZE={given.get('WORLD_SIZE', '1')}"]
    if wrong:
        source = {"srun": "SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID",
                  "mpirun": "OMPI_COMM_WORLD_* (or PMI_*)"}.get(launcher, "them")
        raise CommandRefused(
            f"{', '.join(wrong)} in the environment ({launcher}): a launcher sets RANK and "
            "WORLD_SIZE to whole numbers, RANK below WORLD_SIZE, and LOCAL_RANK to a number; "
            f"to run one process, unset {source}")
    return launcher


def launcher_variables(environ: MutableMapping[str, str]) -> str:
    """discover's work: the variables filled, the launcher named."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        # torchrun's agent sets TORCHELASTIC_RUN_ID, the deepspeed launcher CROSS_RANK
        return ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "deepspeed"
                if "CROSS_RANK" in environ else "a launcher (RANK and WORLD_SIZE set)")
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:  # the batch script has no step
        environ.update(RANK=environ["SLURM_PROCID"], WORLD_SIZE=environ["SLURM_NTASKS"],
                       LOCAL_RANK=environ["SLURM_LOCALID"])
        environ.setdefault("MASTER_ADDR", first_host(environ["SLURM_STEP_NODELIST"]))
        environ.setdefault("MASTER_PORT", str(srun_port(int(environ["SLURM_JOB_ID"]))))
        return "srun"
    for rank, size, local in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                               "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if rank in environ:
            environ.update(RANK=environ[rank], WORLD_SIZE=environ[size],
                           LOCAL_RANK=environ.get(local, "0"))
            if "MASTER_ADDR" not in environ:
                environ["MASTER_ADDR"] = mpi_master_address(environ)
            if "MASTER_PORT" not in environ:
                if environ["RANK"] == "0":
                    check_default_port(DEFAULT_PORT)
                environ["MASTER_PORT"] = str(DEFAULT_PORT)
            return "mpirun"
    return "single process"


def processes_on_this_node(environ: MutableMapping[str, str] = os.environ) -> int:
    """How many processes of the run the launcher starts on this machine (1 when it does not
    say): torchrun, deepspeed, mpirun (OpenMPI, MPICH) or a Slurm job's tasks per node."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if environ.get(name, "").isascii() and environ.get(name, "").isdigit():
            return int(environ[name])
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "8", or "8(x2)"
    if per_node.isascii() and per_node.isdigit():
        return int(per_node)
    return 1


def port_is_free(port: int) -> bool:
    """Whether a rendezvous server could listen on `port` now: torch's TCPStore sets
    SO_REUSEADDR, so a port left in TIME_WAIT by a run that ended is free to it (and to us)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def check_default_port(port: int) -> None:
    """Under mpirun without MASTER_PORT, on rank 0, whose rendezvous listens on `port`: a clear
    error when another process holds it, where torch's would not say that the port is a default.
    No other port is chosen instead: every rank must dial the same one, and where MASTER_ADDR is
    set the ranks exchange nothing before the rendezvous."""
    if not port_is_free(port):
        raise RuntimeError(
            f"port {port}, the rendezvous port under mpirun when MASTER_PORT is unset, is in use "
            "on this machine (rank 0's, where the rendezvous listens): another run or program "
            "holds it. Set MASTER_PORT to a free port for every rank: `export MASTER_PORT=PORT` "
            "before mpirun (OpenMPI on several nodes: `mpirun -x MASTER_PORT ...`)")


def srun_port(job_id: int) -> int:
    first, end = SRUN_PORTS
    return first + job_id % (end - first)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[03-05,07],cpu1", "rack[1-2]-n[01-04]"): its
    first entry, each bracket group replaced by its first value (zero padding kept), as
    `scontrol show hostnames` would list it first."""
    entry = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if entry is None:
        raise ValueError(f"SLURM_STEP_NODELIST {nodelist!r}: not a Slurm node list")
    return re.sub(r"\[([^\]]*)\]", lambda group: re.split(r"[,-]", group.group(1))[0],
                  entry.group(0))


def mpi_master_address(environ) -> str:
    from mpi4py import MPI  # only under mpirun; `pip install tupe_ds[mpi]`

    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    address = None
    if comm.Get_rank() == 0:
        address = "127.0.0.1" if len(set(hosts)) == 1 else interface_address(environ)
    return comm.bcast(address, root=0)


def interface_address(environ) -> str:
    """IPv4 address of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else the first of `hostname -I`."""
    name = environ.get("GLOO_SOCKET_IFNAME") or environ.get("NCCL_SOCKET_IFNAME")
    if name:
        name = name.split(",")[0].lstrip("=")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            SIOCGIFADDR = 0x8915
            request = struct.pack("256s", name.encode()[:15])
            try:
                return socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24])
            except OSError as error:
                raise RuntimeError(f"network interface {name!r} (GLOO_SOCKET_IFNAME / "
                                   f"NCCL_SOCKET_IFNAME) has no IPv4 address: {error}") from None
    return subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                          check=True).stdout.split()[0]
