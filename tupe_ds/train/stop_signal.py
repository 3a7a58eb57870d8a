"""SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (Slurm's warning before preemption): the run saves a
checkpoint and stops."""

import os
import signal
from typing import Optional

import torch
import torch.distributed as dist

INTERRUPTED = (b"tupe-pretrain: SIGINT: stopping at the end of this step with a checkpoint (while "
               b"the run starts: before its first step, nothing to save); Ctrl-C again stops at "
               b"once, without saving\n")


class StopSignal:
    """SIGUSR1 and SIGINT are heard from the start (a run warned or interrupted while it starts
    stops before its first step, with nothing new to save); SIGTERM only from
    `listen_for_sigterm` on, since a launcher ends the ranks of a run that failed to start with
    it. A second SIGINT ends the process at once, unsaved (`interrupt_handler`). Every rank
    learns of a signal received by any rank at the next step boundary."""

    def __init__(self):
        # the signal's number, in a list the handlers hold rather than self: they stay
        # installed after the run, and self holds a process group (any_rank)
        self.received = [0]
        self.group = None  # a gloo group for the flag beside NCCL, made at the first any_rank
        signal.signal(signal.SIGUSR1, handler_setting(self.received))
        signal.signal(signal.SIGINT, interrupt_handler(self.received,
                                                       os.environ.get("RANK", "0") == "0"))

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


def interrupt_handler(received: list, says: bool):
    """Ctrl-C: the first asks the run to stop as SIGTERM does (`says`: this rank tells the user
    at once); the next ends the process by SIGINT's default action, as a user at a terminal
    expects. That default, not Python's KeyboardInterrupt, also ends a process waiting in a
    collective, which KeyboardInterrupt waits for. torchrun passes a terminal's Ctrl-C on to its
    workers once (they run in sessions of their own); the deepspeed launcher sends SIGTERM."""
    def handler(signum, frame):
        received[0] = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if says:
            os.write(2, INTERRUPTED)  # not print: the handler may run in the middle of a print
    return handler


def before_first_step(name: str, step: int, last_checkpoint: Optional[str]) -> tuple:
    """(what the run says, whether it fails on it) when it stops on the signal `name` before the
    first step of this start. Slurm's warning (SIGUSR1) then fails it (exit 3): a job whose time
    limit leaves no time to train one step would stop the same way at every requeue, and
    slurm/srun_requeue.sh requeues only a step that ended with 0."""
    said = (f"stopping before step {step + 1} on {name}: nothing was trained since "
            f"{last_checkpoint or 'the start'}, there is nothing to save")
    if name != "SIGUSR1":
        return said + "; run the same command to continue", False
    return (said + ". SIGUSR1 is Slurm's warning before the time limit (or sent by hand): it came "
            "before this attempt trained a step, so the job is not requeued, as every attempt "
            "would stop the same way. The time limit leaves no time to train: raise sbatch's "
            "--time above the warning's lead (--signal=B:USR1@600 in slurm/pretrain.sbatch: 600 s) "
            "plus the start-up, or lower the lead; then submit the same command again"), True
