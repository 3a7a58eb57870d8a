"""Locks that hold on every filesystem a cluster puts shared folders on, `flock` or not.

`tupe_ds.tools.files.locked` takes `flock` where the filesystem has it (fast, and released by the
kernel when its holder dies). Where `flock` fails for want of support (FLOCK_UNSUPPORTED: ENOSYS
from Lustre mounted without `-o flock`, ENOLCK from NFS without its lock daemon, EOPNOTSUPP or
EINVAL from some FUSE and network filesystems) it takes a LinkLock instead: PATH.holder, made as
the run folder's lock OUT/run.lock is (tupe_ds/train/run_folder/lock.py), from the same records and
rules.

The holder's record (host, boot, PID namespace, PID and its start time, Slurm job, step and restart
count, when it started) is written as JSON to a file of its own and hard-linked to the lock's name,
which fails when the name exists (`link` is atomic on local disks, NFSv3+ and Lustre, the classic
NFS lock), so the lock appears whole or not at all. Whether it was made is judged by the record
file's link count, or else the lock's content, never by what link() answered: over NFS a
retransmitted link() that was done answers EEXIST. While it is held, a thread renews the lease by
touching the file every LEASE_SECONDS / 10; its age is measured against the filesystem's own clock
(the mtime of a file just written there), not this host's, and is never negative: a lease renewed
in the future (a holder's clock ahead) counts as renewed now, and lapses LEASE_SECONDS after it is
first seen (lease_age). A holder is gone, and its lock taken over with a line saying so, when
(gone_because):

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
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from typing import Optional

from tupe_ds.tools import settings
from tupe_ds.tools.errors import NotALockFile
from tupe_ds.tools.log_lines import EVERY_RANK

logger = logging.getLogger(__name__)

LEASE_SECONDS = settings.seconds("TUPE_DS_LOCK_LEASE_SECONDS")  # renewed every tenth
SLURM_FIELDS = {"slurm_job_id": "SLURM_JOB_ID", "slurm_step_id": "SLURM_STEP_ID",
                "slurm_restart_count": "SLURM_RESTART_COUNT"}


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot), None when there is no such process:
    a PID reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"): containers on one host share its name
    and boot, not their PIDs."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_holder() -> dict:
    pid = os.getpid()
    holder = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "boot_id": boot_id(),
              "pid_namespace": pid_namespace(), "pid": pid, "pid_start": process_start(pid),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds")}
    holder.update({field: os.environ[name] for field, name in SLURM_FIELDS.items()
                   if name in os.environ})
    return holder


REQUIRED_FIELDS = {"token": str, "host": str, "pid": int}
OPTIONAL_FIELDS = {"boot_id": str, "pid_namespace": str, "pid_start": int, "started": str,
                   **{field: str for field in SLURM_FIELDS}}
MAX_PID = 2 ** 22  # Linux's largest pid_max: 0 and negative PIDs would name process groups


def parse_holder(data: bytes) -> Optional[dict]:
    """The holder a lock file's bytes name; None when they are no lock record (damaged, the
    module's last rule: a PID of 0 or less would ask the kernel about process groups, and so
    always count as alive)."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    for field, kind in {**REQUIRED_FIELDS, **OPTIONAL_FIELDS}.items():
        value = record.get(field)
        if type(value) is not kind and not (value is None and field in OPTIONAL_FIELDS):
            return None
    return record if 0 < record["pid"] <= MAX_PID else None


def describe(holder: dict) -> str:
    slurm = holder.get("slurm_job_id")
    job = f", Slurm job {slurm}" if slurm else ""
    step = holder.get("slurm_step_id")
    if job and step:
        job += f" step {step}"
    return (f"process {holder['pid']} on {holder['host']}{job}, started "
            f"{holder.get('started') or 'at an unknown time'}")


def same_machine(holder: dict) -> bool:
    """Whether the holder's PID means a process here: the same host, boot and PID namespace."""
    return (holder["host"] == socket.gethostname() and holder.get("boot_id") == boot_id()
            and holder.get("pid_namespace") == pid_namespace())


def alive_here(holder: dict) -> bool:
    """Whether the holder, of this machine (same_machine), is a live process: its PID, with its
    start time."""
    started = process_start(holder["pid"])
    if started is None:  # no such process, or /proc hides it (hidepid): ask the kernel
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return process_start(holder["pid"]) is None  # alive, but its start time unreadable
    return started == holder.get("pid_start", started)


def restarts(count) -> int:
    """SLURM_RESTART_COUNT as recorded (absent before a job's first requeue: 0)."""
    try:
        return int(count or 0)
    except (TypeError, ValueError):
        return 0


def gone_because(holder: Optional[dict], lease_age: float) -> Optional[str]:
    """Why the holder of a lock is gone; None when it may be alive. `lease_age`: seconds since
    its last renewal, on the filesystem's clock and never negative (lease_age)."""
    if holder is None:
        return "the lock file is damaged (not a lock record)"
    if same_machine(holder):
        return None if alive_here(holder) else "its process has ended"
    job = os.environ.get("SLURM_JOB_ID")
    if job is not None and holder.get("slurm_job_id") == job and \
            restarts(holder.get("slurm_restart_count")) < restarts(
                os.environ.get("SLURM_RESTART_COUNT")):
        return f"it is this Slurm job ({job}) before it was requeued"
    if lease_age > LEASE_SECONDS:
        return f"its lease was not renewed for {lease_age:.0f} s (its node is lost)"
    return None


FLOCK_UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)
NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)
HOLDER_SUFFIX = ".holder"
BREAK_SUFFIX = ".break"
BREAK_STALE_SECONDS = 30  # a take-over holds PATH.break for milliseconds
CLOCK_SKEW_SECONDS = 10.0  # between hosts whose clocks a filesystem takes (Lustre's clients)


def write_record(path: str, record: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(record, indent=1))
        f.flush()
        os.fsync(f.fileno())


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def lock_content(path: str) -> Optional[bytes]:
    """What judges a lock: the first 64 KiB of its bytes (a record is far smaller); for a
    symbolic link (no lock this module writes: damaged, taken over by removing the link) where
    it points. None when there is none; NotALockFile when no regular file is there (checked before
    it is opened)."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            return b"a symbolic link to " + os.fsencode(os.readlink(path))
        if stat.S_ISREG(mode):
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with open(descriptor, "rb") as f:
                mode = os.fstat(descriptor).st_mode  # a FIFO put there since, opened not blocking
                if stat.S_ISREG(mode):
                    return f.read(1 << 16)
    except FileNotFoundError:
        return None
    raise NotALockFile(f"{path} is {file_kind(mode)}, not a lock file tupe_ds wrote: remove it, "
                       "then run the same command")


def link_exclusively(source: str, target: str, token: str) -> bool:
    """Whether `target` is now a hard link to `source`, the record with `token`: judged by
    `source`'s link count, or else `target`'s content, never by what link() answered (above)."""
    links = os.stat(source).st_nlink
    with contextlib.suppress(FileExistsError):
        os.link(source, target)
    if os.stat(source).st_nlink > links:
        return True
    try:
        holder = parse_holder(lock_content(target) or b"")
    except NotALockFile:
        return False
    return holder is not None and holder["token"] == token


def lease_age(now: float, path: str) -> Optional[float]:
    """Seconds from the last renewal of the lock `path` (its mtime) to `now` on the filesystem's
    clock; None when there is no lock. Never negative: a renewal in the future (its holder's
    clock ahead, on a filesystem that takes the client's time, or a copied file) is one made
    now. More than CLOCK_SKEW_SECONDS ahead, its time is set to now: its lease then runs out
    LEASE_SECONDS after the first look, for whoever looks next, not hours later (a holder alive
    sets it ahead again at its next renewal). A lock this process may not touch is judged
    renewed now at each look."""
    try:
        age = now - os.lstat(path).st_mtime
        if age < -CLOCK_SKEW_SECONDS:
            with contextlib.suppress(PermissionError):
                os.utime(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return max(age, 0.0)


def replace_lock(path: str, own: str, token: str, judged: bytes) -> bool:
    """Replaces the lock `path`, found gone from its content `judged`, with a hard link to
    `own` (the record with `token`): True when done; False when another process is taking it
    over or the lock changed meanwhile (judge it again)."""
    breaker = path + BREAK_SUFFIX
    if not link_exclusively(own, breaker, token):
        remove_stale_breaker(breaker, own)
        return False
    try:
        if lock_content(path) != judged:
            return False  # released or replaced while we looked
        os.remove(path)
        return link_exclusively(own, path, token)
    finally:
        os.remove(breaker)


def remove_stale_breaker(breaker: str, own: str) -> None:
    """PATH.break, left by a take-over cut short by a kill: removed by the module's rule."""
    age = lease_age(os.stat(own).st_mtime, breaker)
    if age is None:
        return
    with contextlib.suppress(FileNotFoundError):
        taker = parse_holder(lock_content(breaker) or b"")
        if gone_because(taker, 0.0) or age > BREAK_STALE_SECONDS:
            os.remove(breaker)


def lock_support(folder: str) -> tuple:
    """(why `flock` fails in `folder`, why hard links fail there): each an error's text, None
    where it works; OSError when no file can be made there to try."""
    probe = os.path.join(folder, f".lock-probe-{uuid.uuid4().hex}")

    def failure(unsupported: tuple, call, *args) -> Optional[str]:
        try:
            call(*args)
        except OSError as error:
            if error.errno not in unsupported:
                raise
            return os.strerror(error.errno)
        return None

    try:
        with open(probe, "w") as f:
            flock = failure(FLOCK_UNSUPPORTED, fcntl.flock, f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        link = failure(NO_HARD_LINKS, os.link, probe, probe + ".link")
        if link is None:
            os.remove(probe + ".link")
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return flock, link


WAIT_NOTICE_SECONDS = 30.0


class LinkLock:
    """The lock file `path`, held by this process: the lock `locked` takes where `flock` fails,
    and the base of the run folder's (tupe_ds/train/run_folder/lock.py). `lost`: why it is no longer
    this process's, once found out (by the renewal thread, every LEASE_SECONDS / 10, or by
    `lost_because`)."""

    speaker = "tupe_ds"  # the lines it says start with this

    def __init__(self, path: str):
        self.path = path
        self.holder = this_holder()
        self.lost = None
        self.created, self.noticed = time.monotonic(), False  # for what `busy` says
        self._checking = threading.Lock()  # the renewal thread and the caller's checks
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="tupe-lock-lease", daemon=True)

    @classmethod
    def acquire(cls, path: str, fix: str) -> "LinkLock":
        """The lock `path`, taken (over) once free or its holder gone, waiting meanwhile. A
        filesystem without hard links is an error that ends with `fix`."""
        lock = cls(path)
        with lock.own_record() as own:
            pause = 0.01
            while not lock.claim(own, fix):
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
        judged = lock_content(self.path)
        os.utime(own)  # its mtime is now on the filesystem's clock
        age = lease_age(os.stat(own).st_mtime, self.path)
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
        for, saying whom once the wait has lasted WAIT_NOTICE_SECONDS."""
        if self.noticed or time.monotonic() - self.created < WAIT_NOTICE_SECONDS:
            return
        self.noticed = True
        state = ("a live process of this machine" if same_machine(holder) else
                 f"its lease renewed {age:.0f} s ago, taken over once not renewed for "
                 f"{LEASE_SECONDS:.0f} s")
        logger.warning(f"{self.speaker}: waiting for {self.path}, held by {describe(holder)} "
                       f"({state}); if that process is gone, remove {self.path}",
                       extra=EVERY_RANK)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 10):
            try:
                if self.lost_because():
                    return
                os.utime(self.path)
            except OSError:
                pass  # a filesystem that failed for a moment: tried again at the next renewal

    def check(self) -> Optional[str]:
        """None while the lock file is this process's; else what holds it now."""
        try:
            data = lock_content(self.path)
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
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
