"""One job per run folder: OUT/run.lock, taken by the run's rank 0 before any checkpoint is read.

Two jobs on one --out (a resubmission while the first still runs, a requeue that starts before
the old step has died) would set aside each other's saves in progress and log the same steps
twice. The lock file names its holder (host, boot, PID and its start time, Slurm job, step and
restart count, when it started) as JSON.

The mechanism works on every filesystem a cluster puts run folders on, `flock` or not (Lustre
mounted without `-o flock`, NFS with local locks): the holder's record is written to a file of
its own and hard-linked to OUT/run.lock, which fails when the name exists (`link` is atomic on
local disks, NFSv3+ and Lustre, the classic NFS lock), so the lock appears whole or not at all.
While the run lives, a thread renews the lease by touching the file every LEASE_SECONDS / 10;
its age is measured against the filesystem's own clock (the mtime of a file just written there),
not this host's. A holder is gone, and its lock taken over with a line saying so, by the rule
of tupe_ds/tools/lock.py (`gone_because`): its process ended here, it is this Slurm job before a
requeue, its lease elsewhere ran out, or the file is no lock record.

Otherwise the run is refused before any work, naming the holder and what to do (a live process
of this machine holds it until it ends, however long it is stopped). A take-over is itself
exclusive (OUT/run.lock.break, the taker's record, made the same way), so two jobs cannot both
take over one stale lock; one cut short is removed when its taker is gone by these rules, or
after BREAK_STALE_SECONDS. A holder that was taken over (its node frozen beyond the lease) finds
out before its next save (`still_held`) and stops without writing. The records, these rules and
the take-over live in tupe_ds/tools/lock.py, shared with the lock files that replace `flock`
where a filesystem has none (the index cache's, tupe_ds/tools/files.py's `locked`).
"""

import os
import socket
import threading
import time
import uuid
from typing import Optional

import torch.distributed as dist

from tupe_ds.tools.lock import (BREAK_SUFFIX, LEASE_SECONDS, describe, gone_because,
                                link_exclusively, lock_content, parse_holder, read_bytes,
                                renewed_ago, replace_lock, same_machine, this_holder,
                                write_record)
from tupe_ds.train.flags import Refused

LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another live job holds the run folder; the message names it and what to do."""


class RunLock:
    """The lock of one run folder, held by this process (the run's rank 0)."""

    def __init__(self, out: str, holder: dict):
        self.path = os.path.join(out, LOCK_FILE)
        self.holder = holder
        self.lost = None  # why the lock is no longer this run's, once found out
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="tupe-run-lock", daemon=True)

    @classmethod
    def acquire(cls, out: str, say=print) -> "RunLock":
        """The lock of `out`, taken (over); RunFolderBusy when another live job holds it."""
        os.makedirs(out, exist_ok=True)
        lock = cls(out, this_holder())
        own = f"{lock.path}.{lock.holder['token']}"
        write_record(own, lock.holder)
        try:
            for _ in range(20):
                if link_exclusively(own, lock.path):
                    break
                took_over = lock._take_over_if_gone(own, say)
                if took_over:
                    break
                time.sleep(0.1)  # a take-over by another job in progress, or a lock released
            else:
                raise RunFolderBusy(f"{lock.path}: could not be taken in 20 tries: another job "
                                    f"is taking it over ({lock.path}{BREAK_SUFFIX} is there); run "
                                    f"the same command again in a minute")
        finally:
            os.remove(own)
        lock._renewer.start()
        return lock

    def _take_over_if_gone(self, own: str, say) -> bool:
        """Replaces a lock whose holder is gone (True); RunFolderBusy when it may be alive;
        False when the lock changed meanwhile (try again)."""
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            raise RunFolderBusy(f"{self.path} is a folder, not a lock file tupe-pretrain wrote: "
                                "remove it, then run the same command")
        judged = lock_content(self.path)
        age = renewed_ago(own, self.path)
        if judged is None or age is None:
            return False
        holder = parse_holder(judged)
        why = gone_because(holder, age)
        if why is None:
            raise RunFolderBusy(busy_message(self.path, holder, age))
        if not replace_lock(self.path, own, judged):
            return False  # released, replaced or being taken over: judge it again
        whose = describe(holder) if holder else "an unknown holder"
        say(f"tupe-pretrain: took over {self.path} from {whose}: {why}")
        return True

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 10):
            self.lost = self.lost or self._hold()
            if self.lost:
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # checked again at the next renewal, and before every save

    def check(self) -> Optional[str]:
        """None while OUT/run.lock is this run's; else what holds it now."""
        if not os.path.lexists(self.path):
            return f"{self.path} was removed"
        holder = parse_holder(read_bytes(self.path) or b"")
        if holder is None or holder["token"] != self.holder["token"]:
            whose = describe(holder) if holder else "something that is no lock record"
            return f"{self.path} now names {whose}"
        return None

    def _hold(self) -> Optional[str]:
        """check(), taking the lock again where someone removed it (nobody else holds it then)."""
        problem = self.check()
        if problem and not os.path.lexists(self.path):
            own = f"{self.path}.{self.holder['token']}"
            write_record(own, self.holder)
            try:
                if link_exclusively(own, self.path):
                    print(f"tupe-pretrain: {self.path} was removed while this run held it: "
                          "taken again", flush=True)
                    return None
            finally:
                os.remove(own)
            problem = self.check()
        return problem

    def still_held(self) -> Optional[str]:
        """Before a save: None while the lock is this run's; else why the run must stop."""
        self.lost = self.lost or self._hold()
        if self.lost:
            return (f"this run no longer holds its run folder ({self.lost}): another job took "
                    "it over (this one was presumed gone); stopping without saving")
        return None

    def release(self) -> None:
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        if self.check() is None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


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
    if os.path.isdir(path) and not os.path.islink(path):
        return (f"{path} is a folder, not a lock file tupe-pretrain wrote: remove it, then run "
                "the same command")
    data = read_bytes(path)
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
    try:
        age = now - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    holder = parse_holder(data)
    return busy_message(path, holder, age) if gone_because(holder, age) is None else None


def confirm_on_every_rank(lock: Optional[RunLock], out: str) -> None:
    """Collective, right after the rendezvous: every rank finds rank 0's lock in OUT/run.lock,
    so --out is one folder that every node shares; RuntimeError naming the ranks that do not."""
    token = [lock.holder["token"] if lock else None]
    dist.broadcast_object_list(token, src=0)
    data = read_bytes(os.path.join(out, LOCK_FILE))
    holder = parse_holder(data) if data is not None else None
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
