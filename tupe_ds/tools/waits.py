"""Start-up waits that say what they wait for.

A wait of tupe-pretrain on something outside its own process (the other ranks at the rendezvous
or a checkpoint barrier, DeepSpeed building an extension, rank 0 building the sample index or
converting a checkpoint) prints a line naming it once it has lasted NOTICE_SECONDS (30 s;
TUPE_DS_WAIT_NOTICE to change), and again every REPEAT_SECONDS, so that nothing waits in silence.
The texts of tupe-pretrain's own start-up waits live beside what they wait on: the rendezvous's in
tupe_ds/distributed/parallel.py (`rendezvous_text`), that of a wait during which DeepSpeed may
build an extension in tupe_ds/machine/extension_locks.py (`waiting_with_extensions`).
"""

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Union

from tupe_ds.tools import settings

NOTICE_SECONDS = settings.seconds("TUPE_DS_WAIT_NOTICE")
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
