"""The one shape of every command's main(), its errors said the same way in every command.

Each command (tupe-pretrain, tupe-finetune, tupe-export, tupe-compare, tupe-doctor, tupe-smoke,
tupe-prep and the demo) has its work in a function named for it, and

    def main(argv=None) -> int:
        return entry.run("tupe-export", lambda: export_command(argv), errors=(ExportError,))

`run` resumes the collector the command's imports paused (startup.py), shows the loggers' lines
(log_lines.py: information on stdout, warnings and errors on stderr, as the process's rank shows
them), then returns what the command's work returns, its exit code; it turns the errors a person
can act on into a message and an exit code, the same in every command:

- an error of `errors`, or CommandRefused (what the person gave, refused; the message says what to
  change): `PROG: error: MESSAGE` on stderr, exit 2;
- Unreadable (train/checkpoint/reads.py: the filesystem failing for a while): `PROG: MESSAGE` on
  stderr, exit 3: the same command goes on once it reads.

Anything else (a bug) stays a traceback. A command whose checks meet broad classes (OSError,
ValueError, FileNotFoundError) raises CommandRefused from them where it checks its inputs, rather
than naming them in `errors`: the same class raised later, mid-run, is not taken for a refusal."""

import os
import select
import sys
from typing import Callable, MutableMapping

from tupe_ds.tools import log_lines, startup
from tupe_ds.tools.errors import CommandRefused, Unreadable


def run(prog: str, work: Callable[[], int], errors: tuple = ()) -> int:
    """work()'s exit code, after startup.resume_collector() and log_lines.show(); its refusals and
    Unreadable said as above."""
    startup.resume_collector()
    log_lines.show(launcher_rank())
    try:
        return work()
    except Unreadable as unreadable:  # every rank reads alike: each says it
        said(f"{prog}: {unreadable}")
        return 3
    except (CommandRefused, *errors) as refused:  # its message says what to change
        said(f"{prog}: error: {refused}")
        return 2
    except BrokenPipeError:
        if not stdout_broken():
            raise
        return 1  # the reader of stdout ended (`| head -1`): the rest is not wanted


def said(line: str) -> None:
    if sys.stderr is not None:  # None: closed at the start (2>&-)
        print(line, file=sys.stderr, flush=True)


def stdout_broken() -> bool:
    """Whether stdout's reader has gone; then stdout is pointed at /dev/null, so that the
    interpreter's last flush does not fail again."""
    try:
        stdout = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # None, or no file (pytest's capture)
        return False
    poll = select.poll()
    poll.register(stdout, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poll.poll(0)):  # a pipe's, readerless
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), stdout)
    return True


def launcher_rank(environ: MutableMapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher names it, before distributed/launch.py's `discover`
    fills RANK (0: one process)."""
    slurm = ["SLURM_PROCID"] if "SLURM_STEP_ID" in environ else []  # a step's task, not the script
    for name in ["RANK", *slurm, "OMPI_COMM_WORLD_RANK", "PMI_RANK"]:
        if name in environ:  # a value that is no rank is discover's error, said by work()
            return int(environ[name]) if environ[name].isascii() and environ[name].isdigit() \
                else 0
    return 0
