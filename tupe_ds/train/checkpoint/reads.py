"""Reading the run folder through a filesystem that may fail for a while: unreadable is not
damaged. An OSError (EIO, ESTALE) is retried for TUPE_DS_READ_RETRY_SECONDS (default 120), said
once, then the run stops (exit code 3, Unreadable) with nothing moved or deleted; a file not
there, or no regular file, is the checkpoint's damage (docs/reliability.md)."""

import logging
import os
import time
from typing import Callable, List, Optional, TypeVar

import torch.distributed as dist

from tupe_ds.tools import settings
from tupe_ds.tools.log_lines import EVERY_RANK
from tupe_ds.tools.errors import Unreadable, error_text
from tupe_ds.tools.files import regular_file
from tupe_ds.tools.waits import announced

logger = logging.getLogger(__name__)

RETRY_SECONDS = "TUPE_DS_READ_RETRY_SECONDS"
FIRST_PAUSE, LONGEST_PAUSE = 0.1, 5.0

Result = TypeVar("Result")


def retried(path: str, read: Callable[[], Result], expected: bool = False) -> Result:
    """read(), retried while it raises an OSError, then Unreadable naming `path`; FileNotFoundError
    is raised at once, or with `expected` (the manifest lists the file) once the window is over."""
    seconds = settings.seconds(RETRY_SECONDS)
    deadline, pause = time.monotonic() + seconds, FIRST_PAUSE
    while True:
        try:
            return read()
        except OSError as error:
            left = deadline - time.monotonic()
            if isinstance(error, FileNotFoundError) and (not expected or left <= 0):
                raise
            if left <= 0:
                raise Unreadable.reading(path, error, seconds) from None
            if pause == FIRST_PAUSE:
                logger.warning(f"tupe-pretrain: reading {path} failed ({error_text(error)}); "
                               f"trying again for up to {seconds:g} s", extra=EVERY_RANK)
        time.sleep(min(pause, max(left, 0)))
        pause = min(pause * 2, LONGEST_PAUSE)


def read_bytes(path: str, root: Optional[str] = None) -> bytes:
    """The bytes of regular file `path` (inside `root`), retried; FileNotFoundError,
    NotRegularFile."""
    def read():
        with open(regular_file(path, root), "rb") as f:
            return f.read()
    return retried(path, read)


def exists(path: str) -> bool:
    """Whether `path` is there, retried (os.path.exists says False for any error)."""
    return retried(path, lambda: _unless_absent(os.stat, path, None) is not None)


def list_folder(path: str) -> list:
    """The names in folder `path`, retried; [] when it is not there."""
    return retried(path, lambda: _unless_absent(os.listdir, path, []))


def _unless_absent(call: Callable[[str], Result], path: str, absent: Result) -> Result:
    try:
        return call(path)
    except (FileNotFoundError, NotADirectoryError):
        return absent


def gathered(work: Callable[[], Result], waiting_for: str) -> List[Result]:
    """Collective: every rank's work(), in rank order; when any rank's raised Unreadable, every rank
    raises the first one's. `waiting_for`: what a waiting rank says it waits for."""
    rank = dist.get_rank()
    try:
        outcome = (work(), None)
    except Unreadable as unreadable:
        outcome = (None, str(unreadable))
    every_rank = [None] * dist.get_world_size()
    with announced(waiting_for, rank):
        dist.all_gather_object(every_rank, outcome)
    if failed := next((failure for _, failure in every_rank if failure), None):
        raise Unreadable(failed, everywhere=True)
    return [result for result, _ in every_rank]
