"""Read errors for a whole run (tests/test_run_integrity.py): with this folder first on
PYTHONPATH, every process of the run (the launcher's ranks too) fails to open the files whose
path matches the pattern TUPE_DS_EIO_FILES with EIO, as a Lustre or NFS client answers after a
server hiccup: for TUPE_DS_EIO_SECONDS from the process's first such open (default: for ever)."""

import builtins
import errno
import fnmatch
import os
import time

FILES = os.environ.get("TUPE_DS_EIO_FILES")
SECONDS = float(os.environ.get("TUPE_DS_EIO_SECONDS", "inf"))
first_failure = []
opened = builtins.open


def open_or_eio(file, *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and fnmatch.fnmatch(os.path.abspath(file), FILES):
        first_failure[:] = first_failure or [time.monotonic()]
        if time.monotonic() - first_failure[0] < SECONDS:
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(file))
    return opened(file, *args, **kwargs)


if FILES:
    builtins.open = open_or_eio
