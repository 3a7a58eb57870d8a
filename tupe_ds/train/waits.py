"""Start-up waits that say what they wait for.

A wait of tupe-pretrain on something outside its own process (the other ranks at the rendezvous
or a checkpoint barrier, DeepSpeed building an extension, rank 0 building the sample index or
converting a checkpoint) prints a line naming it once it has lasted NOTICE_SECONDS (30 s;
TUPE_DS_WAIT_NOTICE to change), and again every REPEAT_SECONDS, so that nothing waits in silence.
Here too the texts of tupe-pretrain's own start-up waits: the rendezvous, and a wait during which
DeepSpeed may build an extension.
"""

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Union

from tupe_ds.machine.extension_locks import extension_locks, extensions_root, lock_text
from tupe_ds.tools import settings

NOTICE_SECONDS = settings.seconds("TUPE_DS_WAIT_NOTICE", 30.0, least=0.01)
REPEAT_SECONDS = 10 * NOTICE_SECONDS


@contextmanager
def announced(what: Union[str, Callable[[], str]], rank=None):
    """Runs the block; while it lasts beyond NOTICE_SECONDS, prints "waiting N s for WHAT" (a
    callable is asked each time, for a text that looks again at what it waits on)."""
    start = time.monotonic()
    done = threading.Event()
    prefix = "tupe-pretrain" if rank is None else f"tupe-pretrain rank {rank}"

    def watch():
        pause = NOTICE_SECONDS
        while not done.wait(pause):
            text = what() if callable(what) else what
            print(f"{prefix}: waiting {time.monotonic() - start:.0f} s for {text}",
                  file=sys.stdout, flush=True)
            pause = REPEAT_SECONDS

    watcher = threading.Thread(target=watch, name="tupe-wait-notice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def waiting_with_extensions(what: str):
    """A wait during which DeepSpeed may also build or load an extension: its text, with the
    state of every build lock at the time it is printed."""
    def text() -> str:
        locks = [lock_text(*lock) for lock in extension_locks()]
        return (f"{what} (DeepSpeed may be building an extension in {extensions_root()})"
                + "".join(f"; {lock}" for lock in locks))
    return text


def rendezvous_text(world_size: int) -> str:
    if world_size == 1:
        return "the process group of this one process"
    return (f"the rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT): every process of the "
            "run must start")
