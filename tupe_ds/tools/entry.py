"""The one shape of every command's main(), its errors said the same way in every command.

Each command (tupe-pretrain, tupe-finetune, tupe-export, tupe-compare, tupe-doctor, tupe-smoke,
tupe-prep and the demo) has its work in a function named for it, and

    def main(argv=None) -> int:
        return entry.run("tupe-export", lambda: export_command(argv), errors=(ExportError,))

`run` resumes the collector the command's imports paused (startup.py), then returns what the
command's work returns, its exit code; it turns the errors a person can act on into a message
and an exit code, the same in every command:

- an error of `errors`, or CommandRefused (what the person gave, refused; the message says what to
  change): `PROG: error: MESSAGE` on stderr, exit 2;
- Unreadable (train/checkpoint/reads.py: the filesystem failing for a while): `PROG: MESSAGE` on
  stderr, exit 3: the same command goes on once it reads.

Anything else (a bug) stays a traceback. A command whose checks meet broad classes (OSError,
ValueError, FileNotFoundError) raises CommandRefused from them where it checks its inputs, rather
than naming them in `errors`: the same class raised later, mid-run, is not taken for a refusal."""

import sys
from typing import Callable

from tupe_ds.tools import startup
from tupe_ds.tools.errors import CommandRefused, Unreadable


def run(prog: str, work: Callable[[], int], errors: tuple = ()) -> int:
    """work()'s exit code, after startup.resume_collector(); its refusals and Unreadable said as
    above."""
    startup.resume_collector()
    try:
        return work()
    except Unreadable as unreadable:  # every rank reads alike: each says it
        print(f"{prog}: {unreadable}", file=sys.stderr, flush=True)
        return 3
    except (CommandRefused, *errors) as refused:  # its message says what to change
        print(f"{prog}: error: {refused}", file=sys.stderr, flush=True)
        return 2
