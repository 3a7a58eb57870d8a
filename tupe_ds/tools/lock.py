"""Locks that hold on every filesystem a cluster puts shared folders on, `flock` or not.

`tupe_ds.tools.files.locked` takes `flock` where the filesystem has it (fast, and released by the
kernel when its holder dies). Where `flock` fails for want of support (FLOCK_UNSUPPORTED: ENOSYS
from Lustre mounted without `-o flock`, ENOLCK from NFS without its lock daemon, EOPNOTSUPP or
EINVAL from some FUSE and network filesystems) it takes a LinkLock instead: PATH.holder, made
as the run folder's lock OUT/run.lock is (tupe_ds/train/run_lock.py), from the same records and
rules. LinkLock, which takes a lock, waits for it, renews it and gives it back, lives here; the
holder's record and the rules that judge it gone in tupe_ds/tools/lock_holder.py; the lock
file's operations (the hard link, reading it back, the take-over) in tupe_ds/tools/lock_file.py.
The holder's record (host, boot, PID namespace, PID and its start time,
Slurm job, step and restart count, when it started) is written as JSON to a file of its own and
hard-linked to the lock's name, which fails when the name exists (`link` is atomic on local
disks, NFSv3+ and Lustre, the classic NFS lock), so the lock appears whole or not at all. Whether
it was made is judged by the record file's link count, or else the lock's content, never by what
link() answered: over NFS a retransmitted link() that was done answers EEXIST. While
it is held, a thread renews the lease by touching the file every LEASE_SECONDS / 10; its age is
measured against the filesystem's own clock (the mtime of a file just written there), not this
host's, and is never negative: a lease renewed in the future (a holder's clock ahead) counts as
renewed now, and lapses LEASE_SECONDS after it is first seen (lock_file.lease_age). A holder
is gone, and its lock taken over with a line saying so, when (gone_because):

- it ran on this machine (the same host name, boot and PID namespace: containers on one host
  share the first two) and its process (its PID with that PID's start time) has ended;
- it is this same Slurm job before a requeue (the same job id, a lower SLURM_RESTART_COUNT);
- it ran elsewhere and its lease was not renewed for LEASE_SECONDS (600 s;
  TUPE_DS_LOCK_LEASE_SECONDS), the only sign a lost node gives;
- the file is not a lock record (damaged, or a symbolic link): not JSON, a field of another type
  than this module writes, or a PID that names no single process (0 or less: process groups).

Anything else at a lock's name (a folder, a FIFO, a device, a socket) is refused, named, and
left in place (NotALockFile): it may be someone's, and it is checked before it is opened, as
opening a FIFO would wait for a writer forever.

A live holder of this machine holds the lock however long it is stopped, as with `flock`. A
take-over is itself exclusive (PATH.break, the taker's record, made the same way), so two
processes cannot both take over one stale lock; one cut short is removed when its taker is gone
by these rules, or after BREAK_STALE_SECONDS. A LinkLock waits while its holder may be alive,
saying after WAIT_NOTICE_SECONDS whom it waits for and which file to remove if that holder is
gone. A filesystem without hard links either is an error naming the lock. `flock` and a LinkLock
do not exclude each other: nodes that mount one filesystem with and without `flock` (Lustre's
mount options are per client) lock apart.

Why not filelock's SoftFileLease (4.3.1, which has a lease, a heartbeat thread, a compromise
callback and takes a dead holder of this machine over at once, as here): measured, a contender
takes a lease over only once it has itself watched the marker unchanged for the lease's whole
duration on its own clock, so a requeued job would wait 600 s every time and a job finding a
lock that its lost node left hours ago would wait 600 s too, where here the file's age on the
filesystem's clock decides at once (and the Slurm requeue rule has nothing to go on: its marker,
at most 1 KiB of fixed fields, records no Slurm job, restart count or start time, so no message
could name the holder either); it creates the marker with O_EXCL, not a link judged afterwards;
its heartbeat compares inode numbers only, so a take-over that rewrote the file in place went
unseen, and it reports a changed owner only at the second renewal; every contender must pass
the same lease duration or fail (LeaseSettingsMismatch). It would replace the renewal thread
(about 15 lines) and nothing of the rules, records and messages that make up the rest.
"""

import contextlib
import logging
import os
import threading
import time
from typing import Optional

from tupe_ds.tools import lock_file, lock_holder
from tupe_ds.tools.lock_file import (NO_HARD_LINKS, NotALockFile, link_exclusively, renewed_ago,
                                     replace_lock, write_record)
from tupe_ds.tools.lock_holder import (describe, gone_because, parse_holder, same_machine,
                                       this_holder)
from tupe_ds.tools.log_lines import EVERY_RANK

logger = logging.getLogger(__name__)

WAIT_NOTICE_SECONDS = 30.0


class LinkLock:
    """The lock file `path`, held by this process: the lock `locked` takes where `flock` fails,
    and the base of the run folder's (tupe_ds/train/run_lock.py). `lost`: why it is no longer
    this process's, once found out (by the renewal thread, every LEASE_SECONDS / 10, or by
    `lost_because`)."""

    speaker = "tupe_ds"  # the lines it says start with this

    def __init__(self, path: str):
        self.path = path
        self.holder = this_holder()
        self.lost = None
        self._checking = threading.Lock()  # the renewal thread and the caller's checks
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="tupe-lock-lease", daemon=True)

    @classmethod
    def acquire(cls, path: str, fix: str) -> "LinkLock":
        """The lock `path`, taken (over) once free or its holder gone, waiting meanwhile. A
        filesystem without hard links is an error that ends with `fix`."""
        lock = cls(path)
        with lock.own_record() as own:
            started, pause, noticed = time.monotonic(), 0.01, False
            while not lock.claim(own, fix):
                if not noticed and time.monotonic() - started > WAIT_NOTICE_SECONDS:
                    noticed = lock._say_what_it_waits_for(own)
                time.sleep(pause)
                pause = min(2 * pause, 1.0)  # many ranks wait on a shared filesystem
        lock._renewer.start()
        return lock

    @contextlib.contextmanager
    def own_record(self):
        """This holder's record in a file of its own beside the lock, to be hard-linked."""
        own = f"{self.path}.{self.holder['token']}"
        write_record(own, self.holder)
        try:
            yield own
        finally:
            os.remove(own)

    def claim(self, own: str, fix: str) -> bool:
        """Takes the lock, or takes it over when its holder is gone, saying so: True when held;
        False when its holder may be alive (`busy` was told) or it changed meanwhile."""
        try:
            if link_exclusively(own, self.path, self.holder["token"]):
                return True
        except OSError as error:
            if error.errno in NO_HARD_LINKS:
                raise OSError(f"{self.path}: this filesystem can lock files neither with flock "
                              f"nor with hard links ({error.strerror}); {fix}") from error
            raise
        judged = lock_file.lock_content(self.path)
        age = renewed_ago(own, self.path)
        if judged is None or age is None:
            return False
        holder = parse_holder(judged)
        why = gone_because(holder, age)
        if why is None:
            self.busy(holder, age)
            return False
        if not replace_lock(self.path, own, self.holder["token"], judged):
            return False
        logger.warning(f"{self.speaker}: took over {self.path} from "
                       f"{describe(holder) if holder else 'an unknown holder'}: {why}",
                       extra=EVERY_RANK)
        return True

    def busy(self, holder: dict, age: float) -> None:
        """A holder that may be alive holds the lock `age` seconds after it renewed it: waited
        for."""

    def _say_what_it_waits_for(self, own: str) -> bool:
        holder = parse_holder(lock_file.lock_content(self.path) or b"")
        age = renewed_ago(own, self.path)
        if holder is None or age is None:
            return False  # changed meanwhile: said at the next try
        state = ("a live process of this machine" if same_machine(holder) else
                 f"its lease renewed {age:.0f} s ago, taken over once not renewed for "
                 f"{lock_holder.LEASE_SECONDS:.0f} s")
        logger.warning(f"{self.speaker}: waiting for {self.path}, held by {describe(holder)} "
                       f"({state}); if that process is gone, remove {self.path}",
                       extra=EVERY_RANK)
        return True

    def _renew(self) -> None:
        while not self._stop.wait(lock_holder.LEASE_SECONDS / 10):
            try:
                if self.lost_because():
                    return
                os.utime(self.path)
            except OSError:
                pass  # a filesystem that failed for a moment: tried again at the next renewal

    def check(self) -> Optional[str]:
        """None while the lock file is this process's; else what holds it now."""
        try:
            data = lock_file.lock_content(self.path)
        except NotALockFile as error:
            return str(error)
        if data is None:
            return f"{self.path} was removed"
        holder = parse_holder(data)
        if holder is None or holder["token"] != self.holder["token"]:
            whose = describe(holder) if holder else "something that is no lock record"
            return f"{self.path} now names {whose}"
        return None

    def lost_because(self) -> Optional[str]:
        """`lost`, checked now: a lock file someone removed is taken again (nobody else holds
        it then), saying so."""
        with self._checking:
            if not self.lost:
                self.lost = self.check()
                if self.lost and not os.path.lexists(self.path):
                    with self.own_record() as own:
                        if link_exclusively(own, self.path, self.holder["token"]):
                            logger.warning(f"{self.speaker}: {self.path} was removed while "
                                           "this process held it: taken again",
                                           extra=EVERY_RANK)
                    self.lost = self.check()
            return self.lost

    def release(self) -> None:
        """Removes the lock, unless another process took it over meanwhile."""
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        try:
            held = self.check() is None
        except OSError:  # unreadable now: left to its lease, or to this machine's PID rule
            held = False
        if held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
