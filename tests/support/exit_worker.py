"""Runs a tupe_ds command's main() in this process, as its console script would, then checks that
the command left no process group behind: a gloo worker thread still alive when the interpreter
finalizes can abort the process after the work is done
(tupe_ds.distributed.parallel.end_distributed).

    deepspeed --num_gpus 2 tests/support/exit_worker.py finetune ARGS...
    torchrun --nproc_per_node 2 tests/support/exit_worker.py pretrain ARGS...

Prints "exit worker: rank R, exit code C, gloo threads left N" and fails when N > 0.
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import tupe_ds.tools.third_party_warnings  # noqa: F401  (as in the commands it runs)
import os
import sys

from tupe_ds.distributed.parallel import gloo_threads


def main() -> int:
    command, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # deepspeed's
    if command == "pretrain":
        from tupe_ds.pretrain import main as command_main
    elif command == "finetune":
        from tupe_ds.finetune.run import main as command_main
    else:
        raise SystemExit(f"unknown command {command!r}")
    code = command_main(argv)
    left = gloo_threads()
    print(f"exit worker: rank {os.environ.get('RANK', '0')}, exit code {code}, gloo threads left "
          f"{left}", flush=True)
    return code or (3 if left else 0)


if __name__ == "__main__":
    sys.exit(main())
