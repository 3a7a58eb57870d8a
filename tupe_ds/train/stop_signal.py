"""SIGTERM / SIGUSR1 (Slurm's warning before preemption): the run saves a checkpoint and stops."""

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's warning before preemption) ask the run to save and stop.

    Every rank learns of a signal received by any rank at the next step boundary.
    """

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = signal.Signals(signum).name

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
