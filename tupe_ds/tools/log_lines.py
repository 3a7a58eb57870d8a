"""tupe_ds's `logging` lines on a terminal or in a Slurm log, as the rest of the output prints:
the bare message on stdout, in order with the printed lines; every line from rank 0, only errors
from the other ranks (they would repeat rank 0's lines N times)."""

import logging
import sys


class _Stdout(logging.StreamHandler):
    """Writes to the sys.stdout of the moment (pytest's capture replaces it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass


def show(rank: int) -> None:
    """Show the `tupe_ds` loggers' lines as this rank should; called again, changes nothing."""
    root = logging.getLogger("tupe_ds")
    root.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if not any(isinstance(handler, _Stdout) for handler in root.handlers):
        root.addHandler(_Stdout())
    root.propagate = False
