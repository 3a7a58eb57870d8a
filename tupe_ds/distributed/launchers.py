"""Starting a module's processes on this machine as a user would by hand, under the deepspeed
launcher or torchrun: on the user's MASTER_PORT (under torchrun MASTER_ADDR too) when set, else
on a port checked free, chosen again when another process takes it first (launch); the deepspeed
launcher without its INFO lines unless verbose, nor DeepSpeed's CPU fallback warning where
tupe_ds filters it (tupe_ds/tools/third_party_warnings.py)."""

import logging
import os
import random
import sys
from typing import Callable, Optional

from tupe_ds.distributed.launch import SRUN_PORTS, port_is_free, srun_port
from tupe_ds.tools.third_party_warnings import launcher_accelerator, verbose

logger = logging.getLogger(__name__)

LAUNCHERS = ("deepspeed", "torchrun")
PORT_ATTEMPTS = 3
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


def free_port(first: int = None) -> int:
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
                logger.warning(f"tupe_ds: port {start} is in use on this machine: port {port} "
                               "instead")
            return port
    raise RuntimeError(f"no free port from {low} to {end - 1} on this machine")


def launcher_command(launcher: str, processes: int, module: str, argv: list,
                     port: int = None) -> list:
    """`python -m MODULE ARGV` in `processes` processes of this machine, as started by hand: on
    `port`, else the user's MASTER_PORT, else a free one (launch chooses again when it is taken)."""
    port = str(port or users_port() or free_port())
    if launcher == "deepspeed":
        # its only warning is that no hostfile exists, which a run on this machine needs not.
        # No --master_addr: on one machine it gives its ranks 127.0.0.1 whatever it is told.
        quiet = [] if verbose() else ["--log_level", "error"]
        accelerator = launcher_accelerator()
        environment = ["env", f"DS_ACCELERATOR={accelerator}"] if accelerator else []
        prefix = [*environment, sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
                  str(processes), "--master_port", port, *quiet, "--module"]
    else:
        address = os.environ.get("MASTER_ADDR")
        address = ["--master_addr", address] if address else []
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                  str(processes), *address, "--master_port", port, "-m"]
    return [*prefix, module, *argv]


def users_port() -> Optional[int]:
    """The user's MASTER_PORT (None: unset or empty); ValueError saying what to set when it is
    not a port."""
    text = os.environ.get("MASTER_PORT", "")
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"MASTER_PORT={text!r} is not a port: set a number from 1 to 65535, or "
                         "unset it for tupe_ds to choose a free one")
    return int(text)


def launch(launcher: str, processes: int, module: str, argv: list,
           run: Callable[[list], int]) -> int:
    """Runs launcher_command with `run`, which returns its exit code: on the user's MASTER_PORT
    as it is, else on a port chosen here, and again on another (PORT_ATTEMPTS in all) when the
    launch failed while another process holds the chosen one.

    A chosen port cannot be held for the launcher from the check to its use: the deepspeed
    launcher's rank 0 and torchrun's agent open the rendezvous store themselves, on a socket of
    their own (torch's TCPStore takes none handed to it), so another process may take the port
    in between. Then the store fails to listen ("DistNetworkError: The server socket has failed
    to listen on any local network address. port: P, ... EADDRINUSE") before any rank has
    trained a step: a failed launch whose port another process holds afterwards failed so."""
    return on_a_free_port(
        lambda port: run(launcher_command(launcher, processes, module, argv, port)))


def on_a_free_port(attempt: Callable[[int], int]) -> int:
    """`attempt(port)`'s exit code, as `launch` tries it: on the user's MASTER_PORT, else on
    ports chosen here until one is not taken by another process (for callers that build their
    own launcher command)."""
    given = users_port()
    for attempt_number in range(1, PORT_ATTEMPTS + 1):
        port = given or free_port()
        exit_code = attempt(port)
        if exit_code == 0 or given or port_is_free(port) or attempt_number == PORT_ATTEMPTS:
            return exit_code
        logger.warning(f"tupe_ds: port {port} was taken by another process as the launch "
                       "started: launching again on another port")


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
    print(free_port(first))  # a port in use said on stderr (logging's last resort)
    return 0


if __name__ == "__main__":
    sys.exit(main())
