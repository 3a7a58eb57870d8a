"""Reading the run folder through a filesystem that may fail for a while: unreadable is not
damaged.

A Lustre or NFS client answers EIO or ESTALE for seconds after a server hiccup, and a file may
vanish under a read. Such an OSError says nothing about the checkpoint, so it must never make a
checkpoint damaged (set aside, and the run resumed from an older one or from step 0): each read
of the run folder's files is retried with backoff for TUPE_DS_READ_RETRY_SECONDS (default 120),
said once per file, and then the run stops (exit code 3, `Unreadable`) having moved and deleted
nothing, so that the next attempt (Slurm's requeue, the user) finds everything in place.

A file that is not there at all (FileNotFoundError before any byte was read) is missing, and a
path that is no regular file or links out of its folder (`regular_file`) is not the file: both
are the checkpoint's damage, as content that reads and fails its size, checksum or format is.
"""

import os
import time
from typing import Callable, List, Optional, TypeVar

import torch.distributed as dist

from tupe_ds.tools import settings
from tupe_ds.tools.files import regular_file
from tupe_ds.train.flags import TrainingStopped
from tupe_ds.train.waits import announced

RETRY_SECONDS = "TUPE_DS_READ_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 120.0
FIRST_PAUSE, LONGEST_PAUSE = 0.1, 5.0

Result = TypeVar("Result")


class Unreadable(TrainingStopped):
    """A file of the run folder that did not read for the whole retry window: the run stops
    (exit code 3) with nothing moved or deleted. `everywhere`: every rank raises it alike (agreed
    in a collective); else this rank alone, while the others wait for it in a collective."""

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message, everywhere)

    @classmethod
    def reading(cls, path: str, error: OSError, seconds: Optional[float] = None,
                everywhere: bool = False) -> "Unreadable":
        """`path` failed with `error` (for `seconds` of retries, when it was retried)."""
        tried = f" for {seconds:g} s" if seconds else ""
        return cls(f"could not read {path} ({error_text(error)}){tried}: nothing was moved or "
                   "deleted; run the same command once the filesystem answers", everywhere)


def error_text(error: OSError) -> str:
    """`[Errno 5] Input/output error`: the error without the path it names again."""
    if error.errno is None:
        return str(error) or type(error).__name__
    return f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"


def retry_seconds() -> float:
    return settings.seconds(RETRY_SECONDS, DEFAULT_RETRY_SECONDS, least=0)


def retried(path: str, read: Callable[[], Result], expected: bool = False) -> Result:
    """read(), again with backoff while it raises an OSError other than FileNotFoundError (a
    file that is not there is missing, for the caller to say); Unreadable naming `path` once the
    retry window has passed. The first failure is said, once. `expected`: the file must be
    there (its manifest lists it), so FileNotFoundError too is retried, then raised: an NFS
    client may answer ENOENT for a while after a server hiccup."""
    seconds = retry_seconds()
    deadline, pause = time.monotonic() + seconds, FIRST_PAUSE
    while True:
        try:
            return read()
        except OSError as error:
            missing = isinstance(error, FileNotFoundError)
            left = deadline - time.monotonic()
            if missing and (not expected or left <= 0):
                raise
            if left <= 0:
                raise Unreadable.reading(path, error, seconds) from None
            if pause == FIRST_PAUSE:
                print(f"tupe-pretrain: reading {path} failed ({error_text(error)}); trying again "
                      f"for up to {seconds:g} s", flush=True)
        time.sleep(min(pause, max(left, 0)))
        pause = min(pause * 2, LONGEST_PAUSE)


def read_bytes(path: str, root: Optional[str] = None) -> bytes:
    """The bytes of the regular file `path` (inside `root`, when given), retried;
    FileNotFoundError when it is not there, NotRegularFile when it is no regular file."""
    def read():
        with open(regular_file(path, root), "rb") as f:
            return f.read()
    return retried(path, read)


def exists(path: str) -> bool:
    """Whether `path` is there, retried: os.path.exists says False for any error, and a
    manifest that EIO hides would make its checkpoint look incomplete."""
    def there():
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True
    return retried(path, there)


def list_folder(path: str) -> list:
    """The names in folder `path`, retried; [] when it is not there."""
    def names():
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
    return retried(path, names)


def gathered(work: Callable[[], Result], waiting_for: str) -> List[Result]:
    """Collective: work() on every rank, and every rank's result, in rank order; when work()
    raised Unreadable on any rank, every rank raises the first such rank's, so that all stop
    alike (none is left waiting for the others in a collective). `waiting_for`: what a rank
    that waits says it waits for (waits.announced)."""
    rank = dist.get_rank()
    try:
        outcome = (work(), None)
    except Unreadable as unreadable:
        outcome = (None, str(unreadable))
    every_rank = [None] * dist.get_world_size()
    with announced(waiting_for, rank):
        dist.all_gather_object(every_rank, outcome)
    failed = next((failure for _, failure in every_rank if failure), None)
    if failed:
        raise Unreadable(failed, everywhere=True)
    return [result for result, _ in every_rank]
