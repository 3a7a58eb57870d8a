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
        self.received = 0  # the signal's number
        self.group = None  # a gloo group for the flag, made at the first any_rank
        signal.signal(signal.SIGUSR1, self._handler)

    def listen_for_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self.received = signum

    def any_rank(self):
        """Collective, every step: the name of a signal some rank received (None: none did).

        The flag is a host value and goes through a gloo group in host memory: on GPUs, a flag
        on the device would be copied there and read back every step, each a wait for the
        device to finish what was queued before it."""
        if self.group is None:
            self.group = (dist.group.WORLD if dist.get_backend() == "gloo"
                          else dist.new_group(backend="gloo"))
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        received = int(flag.item())
        return signal.Signals(received).name if received else None
