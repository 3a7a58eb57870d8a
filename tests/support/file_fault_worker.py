"""tests/support/exit_worker.py with a run file failing, for tests/test_stop_cleanly.py:

    TUPE_DS_FILE_FAULT="enospc:GLOB:N"   the N-th and every later open for writing of a file whose
        absolute path matches GLOB fails with ENOSPC, as on a full disk (in the ranks that write
        it: rank 0 for the log, TensorBoard's events and run.json)
    TUPE_DS_FILE_FAULT="eio-load:RANK"   DeepSpeed's load of the checkpoint (after its
        verification) fails with EIO on rank RANK alone
    TUPE_DS_FILE_FAULT="eio-open:GLOB:RANK"   every open of a file matching GLOB fails with EIO
        on rank RANK alone

It prints "fault fired: FAULT" as it fires, so that a test tells a fault that fired from one that
never did.
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import builtins
import errno
import fnmatch
import io
import os
import sys

import torch

import exit_worker


def fail(fault: str, code: int, path: str):
    print(f"fault fired: {fault}", flush=True)
    raise OSError(code, os.strerror(code), path)


def failing_opens(fault: str, pattern: str, code: int, writes_only: bool, after: int = 1):
    original, count = builtins.open, [0]

    def open_or_fail(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and (
                not writes_only or set(mode) & set("wax+")) and \
                fnmatch.fnmatch(os.path.abspath(os.fsdecode(file)), pattern):
            count[0] += 1
            if count[0] >= after:
                fail(fault, code, os.fsdecode(file))
        return original(file, mode, *args, **kwargs)

    builtins.open = io.open = open_or_fail


def install(fault: str) -> None:
    kind, *rest = fault.split(":")
    rank = int(os.environ.get("RANK", "0"))
    if kind == "enospc":
        failing_opens(fault, rest[0], errno.ENOSPC, writes_only=True, after=int(rest[1]))
    elif kind == "eio-load":
        if rank != int(rest[0]):
            return
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import \
            TorchCheckpointEngine

        def load(self, path, *args, **kwargs):
            fail(fault, errno.EIO, path)

        TorchCheckpointEngine.load = load
    elif kind == "eio-open":
        if rank == int(rest[1]):
            failing_opens(fault, rest[0], errno.EIO, writes_only=False)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    install(os.environ["TUPE_DS_FILE_FAULT"])
    torch.set_num_threads(1)
    sys.exit(exit_worker.main())
