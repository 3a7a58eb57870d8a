"""A shorter start and end for every tupe_ds process: Python's cyclic garbage collector paused
while torch, DeepSpeed and megatron-core import, and kept off their objects afterwards.

Their import makes about 400,000 Python objects. The collector walks the growing heap again and
again while they are made, and all of it once more while the interpreter tears them down at
exit: of the 5.0 CPU seconds `python -m tupe_ds.pretrain --help` took, 0.8 s went to the first
and 1.1 s to the second (bench/startup.py; bench/README.md, "startup.py", 2026-11-26). Every
launch of every rank pays it, and the test suite launches hundreds. So a command's process:

- pauses the collector from its first import to the first line of its main()
  (`pause_collector`, at the import of this module, which the command imports first;
  `resume_collector`, first in main, by tools/entry.py);
- then freezes what was imported (gc.freeze: the modules live as long as the process; the
  collections during training no longer walk them) and turns the collector back on;
- freezes everything at exit, so that the teardown frees objects without walking them.

The price: the garbage cycles the imports leave (about 10,000, some 10 MB) are frozen with the
modules, kept for the process's life (a resident size 8 MB larger after the imports, 2026-11-26);
collecting them first would cost most of what the pause saves.

Only processes that run a command do this (COMMANDS, their console scripts, the test suite's
workers that call pause_collector), never one that multiprocessing spawns from them: a program
that imports tupe_ds as a library keeps its collector as it was. TUPE_DS_GC=on (or 1, true,
yes) leaves the collector alone in every process (the reference the bench compares with).
"""

import atexit
import gc
import os
import sys

from tupe_ds.tools.settings import switched_on

COMMANDS = {"tupe_ds.pretrain": "tupe-pretrain", "tupe_ds.finetune.run": "tupe-finetune",
            "tupe_ds.export.write": "tupe-export", "tupe_ds.compare.cli": "tupe-compare",
            "tupe_ds.machine.doctor": "tupe-doctor", "tupe_ds.machine.smoke": "tupe-smoke",
            "data_prep.cli": "tupe-prep", "tupe_ds.demo.run": None}
GC_SETTING = "TUPE_DS_GC"
_paused = False


def running_a_command() -> bool:
    """Whether this process's program is one of COMMANDS, by `python -m` or console script."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name in COMMANDS
    return os.path.basename(sys.argv[0] if sys.argv else "") in COMMANDS.values()


def pause_collector() -> None:
    """Turns the collector off until resume_collector, and freezes it at exit (see above). Not in
    a process that multiprocessing spawns (macOS's default, Linux's forkserver): it imports the
    command's module again, and never calls its main()."""
    global _paused
    collector_on = switched_on(GC_SETTING)
    spawned = "multiprocessing.spawn" in sys.modules
    if collector_on or spawned or _paused or not gc.isenabled():
        return
    gc.disable()
    _paused = True
    atexit.register(gc.freeze)  # registered first, run last: after every other exit handler


def resume_collector() -> None:
    """The command's imports are done: freezes them and turns the collector back on."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


if running_a_command():
    pause_collector()
