"""What a tupe_ds process costs outside its steps, as a command starts (tupe_ds/tools/startup.py:
the garbage collector paused while the libraries import, their torch.compile decorations
compiled at first call) and with each reference: the collector left alone (TUPE_DS_GC=on), the
decorations made at import (TUPE_DS_COMPILE_AT_IMPORT=on).

    .venv/bin/python bench/startup.py                           # `tupe-pretrain --help`, 10 each
    .venv/bin/python bench/startup.py --data build/sample-prep-2048 --rounds 5
        # and a tiny 3-step run on 2 CPU ranks under torchrun, as the test suite starts hundreds

The settings take turns, so that noise from the machine falls on all alike. Prints the median
wall and CPU seconds (the process and its children) of each, and the default's over each
reference's.
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tupe_ds.distributed import launchers  # noqa: E402

SETTINGS = {"default": {}, "TUPE_DS_GC=on": {"TUPE_DS_GC": "on"},
            "TUPE_DS_COMPILE_AT_IMPORT=on": {"TUPE_DS_COMPILE_AT_IMPORT": "on"}}


def timed(command, setting: dict):
    """(wall seconds, CPU seconds) of `command` and the processes it starts."""
    env = {**os.environ, "TUPE_DS_GC": "", "TUPE_DS_COMPILE_AT_IMPORT": "", **setting,
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}"
                         f"{result.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(name, command_for, rounds):
    times = {setting: [] for setting in SETTINGS}
    for round_ in range(rounds):
        order = list(SETTINGS.items())
        turn = round_ % len(order)
        for label, setting in order[turn:] + order[:turn]:
            times[label].append(timed(command_for(round_), setting))
    print(f"\n{name}: median of {rounds}")
    medians = {}
    for label, samples in times.items():
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        medians[label] = (wall, cpu)
        print(f"  {label:30s} wall {wall:6.2f} s   CPU {cpu:6.2f} s")
    default_wall, default_cpu = medians.pop("default")
    for label, (wall, cpu) in medians.items():
        print(f"  default / {label:20s} wall {default_wall / wall:6.2f}     CPU "
              f"{default_cpu / cpu:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data", help="a tupe-prep folder: also time a 3-step run on 2 ranks")
    args = parser.parse_args()
    python = sys.executable
    measure("python -m tupe_ds.pretrain --help (imports, then exits)",
            lambda _: [python, "-m", "tupe_ds.pretrain", "--help"], args.rounds)
    if args.data:
        scratch = tempfile.mkdtemp(prefix="bench-startup-")

        def run(round_):
            out = os.path.join(scratch, f"run{round_}-{time.monotonic_ns()}")
            return launchers.launcher_command("torchrun", 2, "tupe_ds.pretrain", [
                    "--data", args.data, "--model", "tiny", "--out", out,
                    "--ds-config", os.path.join(ROOT, "ds_configs", "cpu_zero2.json"),
                    "--seq-len", "64", "--steps", "3", "--global-batch", "8",
                    "--micro-batch", "4", "--eval-samples", "32"])

        try:
            measure("torchrun, 2 ranks, tiny model, 3 steps, a save and a validation", run,
                    args.rounds)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
