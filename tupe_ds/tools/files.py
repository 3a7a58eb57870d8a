"""Outputs that appear whole or not at all: a crash leaves the old file or folder, never half
of a new one."""

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import socket
import stat
from typing import Iterable, Optional, Union

from tupe_ds.tools.errors import NotRegularFile
from tupe_ds.tools.lock import FLOCK_UNSUPPORTED, HOLDER_SUFFIX, LinkLock, file_kind


def file_digest(path: str) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def regular_file(path: str, root: Optional[str] = None) -> str:
    """`path`, once checked to be a regular file (links followed) and, with `root`, to resolve
    inside `root`; NotRegularFile naming it otherwise. FileNotFoundError when it is not there."""
    kind = os.stat(path).st_mode
    if not stat.S_ISREG(kind):
        raise NotRegularFile(f"{path}: not a regular file ({file_kind(kind)}); tupe_ds reads only "
                             "regular files here: remove or replace it")
    if root is not None:
        inside = os.path.realpath(root)
        if os.path.commonpath([inside, os.path.realpath(path)]) != inside:
            raise NotRegularFile(f"{path}: a symbolic link leading out of {root} (to "
                                 f"{os.path.realpath(path)}); tupe_ds reads only files inside it: "
                                 "replace the link with the file itself")
    return path


def temporary_name(path: str, pid: Optional[int] = None) -> str:
    """A temporary file for `path` of this host and process (`pid`: another process of this
    host), so that processes writing the same file at once, on one node or several, never mix
    their bytes: process IDs alone repeat across nodes (and containers)."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


def sync_folder(path: str) -> None:
    """Flushes to disk the names in folder `path`: files created, renamed or removed in it."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        # some filesystems (CIFS, 9p, vboxsf) cannot fsync a folder and say so; PostgreSQL's
        # fsync_fname passes these over too: failing every write there would help no one
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(descriptor)


def make_durable(paths: Iterable[str]) -> None:
    """Flushes each file of `paths` to disk, then each folder holding them (their names): after
    a crash of the node they hold what was written, never less. OSError when the disk or
    filesystem fails to."""
    paths = list(paths)
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)  # Linux: fsync flushes whichever descriptor asks
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    for folder in sorted({os.path.dirname(os.path.abspath(path)) for path in paths}):
        sync_folder(folder)


def write_atomically(path: str, text: Union[str, bytes]) -> None:
    """`text` (or bytes) to `path` through a temporary file of this host and process, flushed to
    disk before it replaces `path`; the replacement is flushed too."""
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        sync_folder(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


@contextlib.contextmanager
def replacing_folder(path: str):
    """Yields an empty folder beside `path` to fill (what a killed run left there removed
    first); when the block ends without an error it replaces `path`, else it is removed."""
    temporary = path.rstrip("/") + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)


@contextlib.contextmanager
def locked(path: str, fix: str = "put it on one that can (a local disk)"):
    """An exclusive lock on the file `path` (created if missing) while the block runs, between
    processes of this machine or, on a shared file system whose locks are global, of a cluster:
    `flock`, released when the block ends or the process dies. Where the filesystem cannot
    `flock`, PATH.holder instead, a lock file with its holder's record and a stated rule for
    when that holder is gone (tupe_ds/tools/lock.py); a filesystem without hard links either is
    an error that ends with `fix`."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in FLOCK_UNSUPPORTED:
                raise
        else:
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
            return
    held = LinkLock.acquire(path + HOLDER_SUFFIX, fix)
    try:
        yield
    finally:
        held.release()
