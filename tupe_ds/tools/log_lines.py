"""tupe_ds's `logging` lines on a terminal or in a Slurm log, as the rest of the output prints:
the bare message on stdout, in order with the printed lines. Rank 0 says every line; the other
ranks only errors and the lines logged with `extra={"every_rank": True}` (what happened on that
rank alone, as a compile that failed there), each after "rank N: ": they would repeat rank 0's
other lines N times."""

import logging
import shutil
import sys

EVERY_RANK = {"every_rank": True}  # `extra=`: a line each rank says, of itself


class _Stdout(logging.StreamHandler):
    """Writes to the sys.stdout of the moment (pytest's capture replaces it). A line logged with
    `extra={"fit": fit}` (the progress line) is fit(columns) on a terminal: what fits its width;
    in a file (a Slurm log, a redirect) it is whole."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass

    def format(self, record: logging.LogRecord) -> str:
        fit = getattr(record, "fit", None)
        if fit is not None and self.stream.isatty():
            bare = logging.makeLogRecord({**record.__dict__, "msg": "", "args": ()})
            prefix = len(super().format(bare))  # "rank N: " on the other ranks
            columns = shutil.get_terminal_size().columns  # $COLUMNS, else the terminal's
            record = logging.makeLogRecord({**record.__dict__, "args": (),
                                            "msg": fit(columns - prefix)})
        return super().format(record)


def show(rank: int) -> None:
    """Show the `tupe_ds` loggers' lines as this rank should; called again, changes nothing."""
    root = logging.getLogger("tupe_ds")
    root.setLevel(logging.INFO)
    root.propagate = False
    handler = next((h for h in root.handlers if isinstance(h, _Stdout)), None)
    if handler is None:
        handler = _Stdout()
        root.addHandler(handler)
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else
                                           f"rank {rank}: %(message)s"))
    handler.filters = [] if rank == 0 else [
        lambda record: record.levelno >= logging.ERROR or getattr(record, "every_rank", False)]
