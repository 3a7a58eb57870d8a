"""Starting a module's processes on this machine as a user would by hand, under the deepspeed
launcher or torchrun: on a port checked free, the deepspeed launcher without its INFO lines
unless verbose (tupe_ds/tools/third_party_warnings.py)."""

import os
import random
import socket
import sys

from tupe_ds.distributed.launch import SRUN_PORTS, srun_port
from tupe_ds.tools.third_party_warnings import verbose

LAUNCHERS = ("deepspeed", "torchrun")
FIRST_PORT = SRUN_PORTS[0]  # below the ephemeral range, as srun's
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports(path: str = PORT_RANGE_FILE) -> tuple:
    """(first, last) of the ports the kernel hands to outgoing connections (gloo's included) and
    to port 0; Linux's default where the file cannot be read."""
    try:
        with open(path) as f:
            first, last = (int(value) for value in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


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


def free_port(first: int = None, say=print) -> int:
    """A port free on this machine now, below the ephemeral range (a port taken from that range
    collides with the connections that the kernel gives ports of the same range): `first` when
    it is free, else the next free one, said in one line. Without `first`, a random start, so
    that runs started at the same moment try different ports."""
    low, ephemeral = FIRST_PORT, ephemeral_ports()[0]
    end = ephemeral if ephemeral > low else 65536  # a machine whose ports are all ephemeral
    start = first if first is not None else random.randrange(low, end)
    for port in [*range(start, max(end, start + 1)), *range(low, start)]:
        if port_is_free(port):
            if port != start:
                say(f"tupe_ds: port {start} is in use on this machine: port {port} instead",
                    flush=True)
            return port
    raise RuntimeError(f"no free port from {low} to {end - 1} on this machine")


def launcher_command(launcher: str, processes: int, module: str, argv: list) -> list:
    """`python -m MODULE ARGV` in `processes` processes of this machine, as started by hand."""
    port = str(free_port())
    if launcher == "deepspeed":
        # its only warning is that no hostfile exists, which a run on this machine needs not
        quiet = [] if verbose() else ["--log_level", "error"]
        prefix = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
                  str(processes), "--master_port", port, *quiet, "--module"]
    else:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                  str(processes), "--master_port", port, "-m"]
    return [*prefix, module, *argv]


def main(argv=None) -> int:
    """`python -m tupe_ds.distributed.launchers srun-port`: prints the rendezvous port of this
    Slurm job (launch.srun_port) or, when that one is in use on this machine, the next free one
    (said on stderr). The Slurm scripts run it on the batch host, the first node of the step,
    where rank 0 listens (slurm/srun_requeue.sh)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["srun-port"] or "SLURM_JOB_ID" not in os.environ:
        print("usage: python -m tupe_ds.distributed.launchers srun-port  (in a Slurm job)",
              file=sys.stderr)
        return 2
    first = srun_port(int(os.environ["SLURM_JOB_ID"]))
    print(free_port(first, say=lambda line, **_: print(line, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
