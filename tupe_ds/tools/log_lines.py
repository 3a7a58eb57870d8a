"""tupe_ds's `logging` lines on a terminal or in a Slurm log, as the rest of the output prints:
the bare message, information on stdout (in order with the printed lines), warnings and errors
on stderr (where a script or a person looks for what went wrong, and off a --print-config's
file). Rank 0 says every line; the other ranks only errors and the lines logged with
`extra={"every_rank": True}` (what happened on that rank alone, as a compile that failed
there), each after "rank N: ": they would repeat rank 0's other lines N times."""

import logging
import os
import shutil
import sys

EVERY_RANK = {"every_rank": True}  # `extra=`: a line each rank says, of itself


class _Stream(logging.StreamHandler):
    """Writes to sys.stdout or sys.stderr as they are at the moment (pytest's capture replaces
    them). A line logged with `extra={"fit": fit}` (the progress line) is fit(columns) on a
    terminal: what fits its width; in a file (a Slurm log, a redirect) it is whole. A stream
    that can no longer be written (a pipe whose reader ended: `| head`) is said once and then
    left alone: the run goes on, its log and TensorBoard keep every figure."""

    def __init__(self, name: str, levels):
        super().__init__()
        self.stream_name, self.broken = name, False
        self.addFilter(lambda record: record.levelno in levels)

    @property
    def stream(self):
        return getattr(sys, self.stream_name)

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

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken and self.stream is not None:  # None: closed at the start (>&-)
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            return super().handleError(record)
        self.broken = True
        os.write(2, f"tupe_ds: {self.stream_name} cannot be written ({error}): its lines are "
                    "no longer shown\n".encode())


LEVELS = {"stdout": range(logging.WARNING), "stderr": range(logging.WARNING, logging.CRITICAL + 1)}


PACKAGES = ("tupe_ds", "data_prep")  # the project's: their modules' loggers


def show(rank: int) -> None:
    """Show the PACKAGES' loggers' lines as this rank should, and those of __main__ when it is
    one of their modules (`python -m tupe_ds.finetune.run`: not a script that imports them);
    called again, changes nothing."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    ours = main is not None and main.name.split(".")[0] in PACKAGES
    roots = [logging.getLogger(name) for name in [*PACKAGES, *(["__main__"] if ours else [])]]
    for root in roots:
        root.setLevel(logging.INFO)
        root.propagate = False
    for name, levels in LEVELS.items():
        handler = next((h for h in roots[0].handlers if isinstance(h, _Stream)
                        and h.stream_name == name), None) or _Stream(name, levels)
        for root in roots:
            if handler not in root.handlers:
                root.addHandler(handler)
        handler.broken = False
        handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else
                                               f"rank {rank}: %(message)s"))
        handler.filters = handler.filters[:1] + ([] if rank == 0 else [
            lambda record: record.levelno >= logging.ERROR or getattr(record, "every_rank", False)])
