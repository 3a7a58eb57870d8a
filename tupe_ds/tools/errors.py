"""Every error tupe_ds raises for a person to read, in one place. Library code raises them; only
a command's entry point (its main()) turns one into a message and an exit code, so that no
module below the commands ends a process.

Refused and TrainingStopped say tupe-pretrain's exit codes; every command's main() is
tools/entry.py's `run`, which says how the others' refusals (CompareError, ExportError, ...;
CommandRefused) and Unreadable end them."""

import os
from typing import Optional


# --- tupe-pretrain -------------------------------------------------------------------------------

class Refused(RuntimeError):
    """A setting, or what --out holds, that tupe-pretrain refuses: before any process group, or
    once it exists (what the checkpoint's files hold, what every rank sees), where every rank
    raises it alike and rank 0 says it once. Exit code 2."""


class TrainingStopped(RuntimeError):
    """The run cannot go on by itself (non-finite steps or weights, a checkpoint it could not
    write, its run folder taken over); its message says why. `everywhere`: every rank stopped
    alike (else only this one: the others wait in a collective, for the launcher to end them).
    Exit code 3."""

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


class Unreadable(TrainingStopped):
    """A file that did not read for the retry window (train/checkpoint/reads.py); `everywhere`:
    every rank raises it alike."""

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message, everywhere)

    @classmethod
    def reading(cls, path: str, error: OSError, seconds: Optional[float] = None) -> "Unreadable":
        tried = f" for {seconds:g} s" if seconds else ""
        return cls(f"could not read {path} ({error_text(error)}){tried}: nothing was moved or "
                   "deleted; run the same command once the filesystem answers")


def error_text(error: OSError) -> str:
    """`[Errno 5] Input/output error`: the error without the path it names again."""
    if error.errno is None:
        return str(error) or type(error).__name__
    return f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"


class FolderTakenOver(TrainingStopped):
    """Another job took this run's folder over: rank 0 stops alone, writing nothing more."""

    def __init__(self, message: str):
        super().__init__(message, everywhere=False)


class RunFolderBusy(RuntimeError):
    """Another live job holds the run folder, or something no lock of ours leaves is at
    OUT/run.lock; the message names it and what to do."""


class HistoryDamaged(ValueError):
    """A record of OUT/history.jsonl other than its last does not read: refused, never guessed."""


class NonFiniteWeights(RuntimeError):
    """The model holds a value that is not finite: nothing is saved."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written or committed: the previous complete one stands.
    `everywhere`: every rank raised it; else only those whose own writes failed. `remedy`: what
    to do, where it is not to free space and run the same command."""

    def __init__(self, message: str, everywhere: bool, remedy: str = ""):
        super().__init__(message)
        self.everywhere, self.remedy = everywhere, remedy


class OtherSoftware(Exception):
    """An intact file of a checkpoint names a type this software does not load, and other
    versions wrote it (train/checkpoint/safe_load.py says which)."""


# --- the run folder's files ----------------------------------------------------------------------

class NotRegularFile(ValueError):
    """A path a run reads is no regular file (a FIFO, device, socket or folder would hang or
    fail the read), or a symbolic link leading out of the folder it must stay in."""


class NotALockFile(OSError):
    """Something no lock of tools/lock.py leaves is at a lock's name (a folder, a FIFO, a
    device, a socket): never removed, as it may be someone's; the message says to remove it."""


# --- the other commands --------------------------------------------------------------------------

class CommandRefused(Exception):
    """What a person gave a command, refused where the command checks it (the message says what
    to change): tools/entry.py says it as `PROG: error: MESSAGE`, exit code 2. A command raises
    it from the broad classes its checks meet (OSError, ValueError), so that the same class
    raised later, a bug mid-run, stays a traceback."""


class CompareError(Exception):
    """tupe-compare: a comparison that cannot be planned or go on, and what to change."""


class ExportError(Exception):
    """tupe-export and the exported model's readers: a folder that is not what they need."""


class TaskDataError(ValueError):
    """tupe-finetune: a GLUE task's files missing or malformed, named with the line."""


class BatchSizeError(ValueError):
    """tupe-finetune: batch sizes that do not split over the processes."""


class TaskBusy(RuntimeError):
    """tupe-finetune: another tupe-finetune is fine-tuning the task into the same folder."""
