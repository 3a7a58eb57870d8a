"""The progress of long work (tupe-prep's passes, its merge) as a person reads it where it goes:
tqdm's bar on a terminal; elsewhere (a Slurm log, a file, a pipe), where tqdm would write bars
joined by carriage returns, a plain line every TUPE_DS_PROGRESS_SECONDS (60 s) and one at the
end, each with the count, the rate and the time left (as tupe-finetune's log points)."""

import sys

from tqdm import tqdm

from tupe_ds.tools import settings

PLAIN = {True: "{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%), {rate_fmt}, {elapsed} "
               "elapsed, {remaining} left",
         False: "{desc}: {n_fmt}{unit}, {rate_fmt}, {elapsed} elapsed"}  # by: total known


class Bar(tqdm):
    """tqdm, with plain lines where its file (stderr by default) is no terminal."""

    def __init__(self, *args, file=None, **kwargs):
        file = file or sys.stderr
        self.plain = not (hasattr(file, "isatty") and file.isatty())
        if self.plain:
            kwargs.update(mininterval=settings.seconds("TUPE_DS_PROGRESS_SECONDS"),
                          bar_format=PLAIN[kwargs.get("total") is not None])
        super().__init__(*args, file=file, **kwargs)

    def display(self, msg=None, pos=None):
        if not self.plain:
            return super().display(msg, pos)
        if msg is None and self.n:  # a message '' clears a bar: in a file, nothing to clear
            self.line()
        return False

    def line(self) -> None:
        self.fp.write(f"{self}\n")
        self.fp.flush()
        self.written = self.n

    def close(self):
        if self.plain and not self.disable:
            self.leave = False  # the last line is written here, not ended by tqdm's '\n'
            self._ema_dt = lambda: None  # its rate over the whole work, as tqdm's last one
            if getattr(self, "written", None) != self.n:  # not the line just written again
                self.line()
        super().close()
