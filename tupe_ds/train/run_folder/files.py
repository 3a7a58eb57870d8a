"""A run file that cannot be written or read while the run trains (a full disk, a read error:
train_log.jsonl, TensorBoard's events, run.json, the data and its sample indexes, the tokenizer)
stops every rank alike, with exit code 3 and one line naming the file, the error and the newest
intact checkpoint to resume from. The rank whose write failed notes it and goes on to the next
agreement (`agreed`, a collective at the points where such failures surface: the start, each log
interval, the end), where every rank learns of it and stops."""

import os
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from tupe_ds.tools.errors import FolderTakenOver, TrainingStopped, error_text
from tupe_ds.tools.waits import announced

Result = TypeVar("Result")


def failed(doing: str, error: BaseException, path: str) -> str:
    """`could not write OUT/train_log.jsonl ([Errno 28] No space left on device)`: what failed,
    the file the error names or else `path`. A TrainingStopped says its own message."""
    if isinstance(error, OSError):
        return f"could not {doing} {error.filename or path} ({error_text(error)})"
    return str(error)


def stop_message(failure: str, newest: Optional[str]) -> str:
    if newest is None:
        return (f"{failure}; the run has no checkpoint yet (run the same command once the "
                "filesystem has space and answers: it starts from step 0)")
    return (f"{failure}; the newest intact checkpoint is {newest} (run the same command once the "
            "filesystem has space and answers: it resumes from there)")


def takes_writes(folder: str, size: int = 1 << 20) -> None:
    """OSError unless `folder` takes a write of `size` bytes to disk (a full disk shows here, in
    one line, before the engine's build, where it would end in a traceback on one rank)."""
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(size))
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def agreed(failure: Optional[str], newest: Optional[str], waiting_for: str) -> Optional[str]:
    """Collective: the stop message of the first rank whose `failure` is not None (None: no rank
    failed). `newest`: the tag of the newest intact checkpoint (None: none)."""
    every_rank = [None] * dist.get_world_size()
    with announced(waiting_for, dist.get_rank()):
        dist.all_gather_object(every_rank, failure)
    first = next((line for line in every_rank if line), None)
    return stop_message(first, newest) if first else None


def on_every_rank(work: Callable[[], Result], doing: str, path: str, newest: Optional[str],
                  waiting_for: str) -> Result:
    """Collective: work() on every rank; TrainingStopped on every rank when it raised an OSError
    (or stopped the run: a file retried for the whole window) on any rank. A run folder another
    job took over stops rank 0 alone, as everywhere else (lock.py)."""
    failure, result = None, None
    try:
        result = work()
    except FolderTakenOver:
        raise
    except (OSError, TrainingStopped) as error:
        failure = failed(doing, error, path)
    stop = agreed(failure, newest, waiting_for)
    if stop:
        raise TrainingStopped(stop)
    return result
