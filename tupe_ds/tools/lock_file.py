"""A lock file on disk: its record hard-linked to the lock's name, read back, and taken over.

The operations of tupe_ds/tools/lock.py's locks on their files: the holder's record written to a
file of its own and hard-linked to the lock's name (`link_exclusively`, judged by link count or
content), the lock's content read without opening what is no regular file (`lock_content`,
NotALockFile), its age on the filesystem's clock (`lease_age`), a take-over made exclusive by
PATH.break (`replace_lock`), and the probe of whether a folder's filesystem has `flock` and hard
links.
"""

import contextlib
import errno
import fcntl
import json
import os
import stat
import uuid
from typing import Optional

from tupe_ds.tools.errors import NotALockFile
from tupe_ds.tools.lock_holder import gone_because, parse_holder

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
    it points. None when there is none; NotALockFile when no regular file is there, checked
    before it is opened: opening a FIFO would wait for a writer forever."""
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


def holds(path: str, token: str) -> bool:
    """Whether the lock file `path` is the record with `token`."""
    holder = parse_holder(lock_content(path) or b"")
    return holder is not None and holder["token"] == token


def link_exclusively(source: str, target: str, token: str) -> bool:
    """Whether `target` is now a hard link to `source`, the record with `token`. Judged by
    `source`'s link count, or else `target`'s content, whatever link() answered: over NFS a
    retransmitted link() that was done answers EEXIST."""
    links = os.stat(source).st_nlink
    try:
        os.link(source, target)
    except FileExistsError:
        pass
    if os.stat(source).st_nlink > links:
        return True
    try:
        return holds(target, token)
    except NotALockFile:
        return False


def renewed_ago(own: str, path: str) -> Optional[float]:
    """Seconds since the lock `path` was last renewed, on the filesystem's clock (`own`: a file
    of this process beside it, touched now); None when there is no lock."""
    os.utime(own)
    return lease_age(os.stat(own).st_mtime, path)


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
    """A take-over cut short by a kill leaves PATH.break (its taker's record): removed at once
    when the taker is gone by the lock's own rules, else once it is BREAK_STALE_SECONDS old."""
    age = lease_age(os.stat(own).st_mtime, breaker)
    if age is None:
        return
    try:
        taker = parse_holder(lock_content(breaker) or b"")
        if gone_because(taker, 0.0) or age > BREAK_STALE_SECONDS:
            os.remove(breaker)
    except FileNotFoundError:
        pass


def lock_support(folder: str) -> tuple:
    """(why `flock` fails in `folder`, why hard links fail there): each an error's text, None
    where it works; OSError when no file can be made there to try."""
    probe = os.path.join(folder, f".lock-probe-{uuid.uuid4().hex}")
    failures = []
    try:
        with open(probe, "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                failures.append(None)
            except OSError as error:
                if error.errno not in FLOCK_UNSUPPORTED:
                    raise
                failures.append(os.strerror(error.errno))
        try:
            os.link(probe, probe + ".link")
            os.remove(probe + ".link")
            failures.append(None)
        except OSError as error:
            if error.errno not in NO_HARD_LINKS:
                raise
            failures.append(os.strerror(error.errno))
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return tuple(failures)
