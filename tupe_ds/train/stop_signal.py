"""SIGTERM / SIGUSR1 (Slurm's warning before preemption): the run saves a checkpoint and stops."""

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's warning before preemption) ask the run to save and stop.

    Every rank learns of a signal received by any rank at the next step boundary.
    """

    def __init__(self):
        self.received = 0  # the signal's number
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = signum

    def any_rank(self, device):
        """Collective: the name of a signal some rank received (None: none did)."""
        flag = torch.tensor([float(self.received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None
