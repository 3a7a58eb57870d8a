"""One job per run folder: OUT/run.lock, taken by the run's rank 0 before any checkpoint is read.

Two jobs on one --out (a resubmission while the first still runs, a requeue that starts before
the old step has died) would set aside each other's saves in progress and log the same steps
twice. OUT/run.lock is a lock file of tupe_ds/tools/lock.py, by its records and rules. What is
the run's own: a holder that may be alive refuses the run before any work, naming it and what
to do; so does anything at OUT/run.lock that no lock of ours leaves (a folder, a FIFO: never
removed, it may be someone's). And a run whose lock another job took over (its node frozen
beyond the lease, then back) writes nothing more: rank 0 checks the lock before each write to
the run folder (`stop_unless_held`), as a frozen process resumes with the renewal thread asleep;
before each save every rank stops alike (`lost_on_rank_0`).
"""

import os
import socket
import time
import uuid
from typing import Optional

import torch.distributed as dist

from tupe_ds.tools.errors import FolderTakenOver, NotALockFile, Refused, RunFolderBusy
from tupe_ds.tools.lock import (LEASE_SECONDS, LinkLock, describe, gone_because, lease_age,
                               lock_content, parse_holder, same_machine, write_record)
from tupe_ds.train.checkpoint import reads

LOCK_FILE = "run.lock"


class RunLock(LinkLock):
    """The lock of one run folder, held by this process (the run's rank 0)."""

    speaker = "tupe-pretrain"

    @classmethod
    def acquire(cls, out: str) -> "RunLock":
        """The lock of `out`, taken (over); RunFolderBusy when another live job holds it."""
        os.makedirs(out, exist_ok=True)
        lock = cls(os.path.join(out, LOCK_FILE))
        try:
            with lock.own_record() as own:
                for _ in range(20):
                    if lock.claim(own, "put --out on another filesystem"):
                        break
                    time.sleep(0.1)  # a take-over by another job in progress, or a lock released
                else:
                    raise RunFolderBusy(f"{lock.path}: could not be taken in 20 tries: another "
                                        f"job is taking it over ({lock.path}.break is there); "
                                        "run the same command again in a minute")
        except NotALockFile as error:
            raise RunFolderBusy(str(error)) from None
        lock._renewer.start()
        return lock

    def busy(self, holder: dict, age: float) -> None:
        raise RunFolderBusy(busy_message(self.path, holder, age))

    def still_held(self) -> Optional[str]:
        """None while the lock is this run's; else why the run must stop (reads.Unreadable when
        the lock file does not read for the retry window)."""
        lost = reads.retried(self.path, self.lost_because)
        if lost:
            return (f"this run no longer holds its run folder ({lost}): another job took it "
                    "over (this one was presumed gone); stopping without saving")
        return None

    def stop_unless_held(self) -> None:
        """Before each write rank 0 makes to the run folder after its start: TrainingStopped
        when another job took the folder over, so that this run writes nothing more. Rank 0
        stops alone (the others wait in a collective, for the launcher to end them): a check
        per write must cost no collective."""
        lost = self.still_held()
        if lost:
            raise FolderTakenOver(lost)


def busy_message(path: str, holder: dict, age: float) -> str:
    said = (f"{path}: this run folder is in use by {describe(holder)}, a live process of this "
            "machine" if same_machine(holder) else
            f"{path}: this run folder is in use by {describe(holder)} (its lease renewed "
            f"{age:.0f} s ago)")
    said += (". Two jobs on one --out would overwrite each other's checkpoints and logs. Wait "
             "for that job to end, or give this one another --out.")
    if same_machine(holder):
        return said + f" (A stopped process holds it too: end it, kill {holder['pid']}.)"
    left = max(LEASE_SECONDS - age, 0)
    return said + (f" If that job is gone (its node lost), this lock is taken over once its "
                   f"lease runs out ({left:.0f} s from now): run the same command then.")


def check(out: str) -> Optional[str]:
    """For --check-only: the refusal a run on `out` would meet now (None: it would start)."""
    path = os.path.join(out, LOCK_FILE)
    try:
        data = lock_content(path)
    except NotALockFile as error:
        return str(error)
    if data is None:
        return None
    probe = f"{path}.probe-{uuid.uuid4().hex}"
    try:
        write_record(probe, {})
        now = os.stat(probe).st_mtime  # the filesystem's clock
    except OSError:
        now = time.time()  # a folder this process may not write: this host's clock
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    age = lease_age(now, path)
    if age is None:
        return None
    holder = parse_holder(data)
    return busy_message(path, holder, age) if gone_because(holder, age) is None else None


def confirm_on_every_rank(lock: Optional[RunLock], out: str) -> None:
    """Collective, right after the rendezvous: every rank finds rank 0's lock in OUT/run.lock,
    so --out is one folder that every node shares; RuntimeError naming the ranks that do not."""
    token = [lock.holder["token"] if lock else None]
    dist.broadcast_object_list(token, src=0)
    try:
        holder = parse_holder(lock_content(os.path.join(out, LOCK_FILE)) or b"")
    except NotALockFile:
        holder = None
    mine = None if token[0] is None or (holder and holder["token"] == token[0]) else (
        f"rank {dist.get_rank()} on {socket.gethostname()} finds "
        + (describe(holder) if holder else "no lock record"))
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    differing = [line for line in every_rank if line]
    if differing:
        raise Refused(f"{os.path.join(out, LOCK_FILE)}: rank 0 holds it, but "
                      + "; ".join(differing) + ": --out must be one folder that every node "
                      "shares (the same path on a shared filesystem)")


def lost_on_rank_0(lock: Optional[RunLock]) -> Optional[str]:
    """Collective, before each save: why the run must stop because another job took its run
    folder over (None: it holds it still)."""
    lost = [lock.still_held() if lock else None]
    dist.broadcast_object_list(lost, src=0)
    return lost[0]
