"""The one shape of every command's main(), its errors said the same way in every command.

Each command (tupe-pretrain, tupe-finetune, tupe-export, tupe-compare, tupe-doctor, tupe-smoke,
tupe-prep and the demo) has its work in a function named for it, and

    def main(argv=None) -> int:
        return entry.run("tupe-export", lambda: export_command(argv), errors=(ExportError,))

`run` resumes the collector the command's imports paused (startup.py), shows the loggers' lines
(log_lines.py: information on stdout, warnings and errors on stderr, as the process's rank shows them),
then returns what the command's work returns, its exit code; it turns the errors a person can act on into a message
and an exit code, the same in every command:

- an error of `errors`, or CommandRefused (what the person gave, refused; the message says what to
  change): `PROG: error: MESSAGE` on stderr, exit 2;
- Unreadable (train/checkpoint/reads.py: the filesystem failing for a while): `PROG: MESSAGE` on
  stderr, exit 3: the same command goes on once it reads.

Anything else (a bug) stays a traceback. A command whose checks meet broad classes (OSError,
ValueError, FileNotFoundError) raises CommandRefused from them where it checks its inputs, rather
than naming them in `errors`: the same class raised later, mid-run, is not taken for a refusal."""

import os
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
        print(f"{prog}: {unreadable}", file=sys.stderr, flush=True)
        return 3
    except (CommandRefused, *errors) as refused:  # its message says what to change
        print(f"{prog}: error: {refused}", file=sys.stderr, flush=True)
        return 2


def launcher_rank(environ: MutableMapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher names it, before distributed/launch.py's `discover`
    fills RANK (0: one process)."""
    slurm = ["SLURM_PROCID"] if "SLURM_STEP_ID" in environ else []  # a step's task, not the script
    for name in ["RANK", *slurm, "OMPI_COMM_WORLD_RANK", "PMI_RANK"]:
        if name in environ:
            return int(environ[name])
    return 0
