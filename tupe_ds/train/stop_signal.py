"""SIGTERM / SIGUSR1 (Slurm's warning before preemption): the run saves a checkpoint and stops."""

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGUSR1 (Slurm's warning before preemption) and, once training begins, SIGTERM ask the
    run to save and stop.

    SIGUSR1 is heard from the start (a job warned while it starts stops before its first step,
    with nothing new to save); SIGTERM only from `listen_for_sigterm` on, since a launcher ends
    the ranks of a run that failed to start with it. Every rank learns of a signal received by
    any rank at the next step boundary.
    """

    def __init__(self):
        # the signal's number, in a list the handler holds rather than self: the handler stays
        # installed after the run, and self holds a process group (any_rank)
        self.received = [0]
        self.group = None  # a gloo group for the flag beside NCCL, made at the first any_rank
        signal.signal(signal.SIGUSR1, handler_setting(self.received))

    def listen_for_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, handler_setting(self.received))

    def any_rank(self):
        """Collective, every step: the name of a signal some rank received (None: none did).

        The flag is a host value and goes through a gloo group in host memory: on GPUs, a flag
        on the device would be copied there and read back every step, each a wait for the
        device to finish what was queued before it."""
        if self.group is None and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        flag = torch.tensor(self.received, dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # None: the world's
        received = int(flag.item())
        return signal.Signals(received).name if received else None


def handler_setting(received: list):
    def handler(signum, frame):
        received[0] = signum
    return handler
