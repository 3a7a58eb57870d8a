"""What flushing a checkpoint to disk costs: a rank's save with and without the fsyncs that
tupe_ds makes before a checkpoint counts and before retention deletes an older one
(tupe_ds/train/checkpoint/save.py: each file, then its folder, then the checkpoints folder).

Each round saves one checkpoint as a rank does: its weights (torch.save of fp32 tensors of the
model's size, as `mp_rank_00_model_states.pt`) and its random state (`rng_rank0.pt`) into a
fresh stepN folder under --folder; "fsync" then flushes them (tupe_ds.tools.files.make_durable
and sync_folder, the functions the save calls), "no fsync" does not. The two take turns, --rounds
each; before every round the previous one's folder is removed and os.sync() flushes what is left
(untimed), so that each starts with no dirty pages. Sizes: BERT-Base (110M parameters, 440 MB)
and a small model (12M, 47 MB: step_time.py's default).

What it measures depends on where --folder is: on a disk, "no fsync" is a write into the page
cache (the kernel writes it back later, off the save's clock) and "fsync" waits for the disk; on
tmpfs an fsync does nothing. The filesystem of --folder is printed. Prints the median seconds
and MB/s of each, the fsyncs' own median, and the ratio fsync / no fsync, measured in this run.

    python bench/checkpoint_fsync.py [--rounds 5] [--folder build/bench-checkpoint-fsync]
        [--sizes bert-base,small] [--json F]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tupe_ds.tools.third_party_warnings  # noqa: F401,E402  (first: filters import warnings)
from tupe_ds.tools.files import make_durable, sync_folder, write_atomically  # noqa: E402
from tupe_ds.train.checkpoint.loading import file_name, rng_state  # noqa: E402

PARAMETERS = {"bert-base": 110_000_000, "small": 11_800_000}
TENSOR = 4_000_000  # parameters a tensor: BERT-Base's are 0.6M-23M


def filesystem(path: str) -> str:
    """The type and mount point of the filesystem holding `path` (/proc/self/mountinfo)."""
    path, best = os.path.realpath(path), ("?", "")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount, kind = fields[4], fields[fields.index("-") + 1]
            if os.path.commonpath([mount, path]) == mount and len(mount) >= len(best[1]):
                best = (kind, mount)
    return f"{best[0]} (mounted at {best[1]})"


def weights(parameters: int) -> dict:
    sizes = [TENSOR] * (parameters // TENSOR) + [parameters % TENSOR]
    return {"module": {f"layer{i}.weight": torch.randn(size) for i, size in enumerate(sizes)}}


def save_once(checkpoints: str, step: int, state: dict, flush: bool) -> tuple:
    """(seconds of the save, seconds of its fsyncs) of one checkpoint, stepN under
    `checkpoints`."""
    folder = os.path.join(checkpoints, f"step{step}")
    start = time.perf_counter()
    os.makedirs(folder)
    paths = [os.path.join(folder, "mp_rank_00_model_states.pt"),
             os.path.join(folder, file_name(0))]
    torch.save(state, paths[0])
    torch.save(rng_state(), paths[1])
    written = time.perf_counter()
    if flush:
        make_durable(paths)
        sync_folder(checkpoints)
    end = time.perf_counter()
    return end - start, end - written


def measure(checkpoints: str, parameters: int, rounds: int) -> dict:
    state = weights(parameters)
    times = {True: [], False: []}
    syncs, writes = [], []
    step = 0
    save_once(checkpoints + ".warm-up", step, state, False)  # untimed: torch's first save
    shutil.rmtree(checkpoints + ".warm-up")
    for turn in range(rounds):
        for flush in ((True, False) if turn % 2 else (False, True)):
            shutil.rmtree(checkpoints, ignore_errors=True)
            os.makedirs(checkpoints)
            os.sync()
            step += 1
            seconds, flushing = save_once(checkpoints, step, state, flush)
            times[flush].append(seconds)
            if flush:
                syncs.append(flushing)
                writes.append(seconds - flushing)
    last = os.path.join(checkpoints, f"step{step}")
    size = sum(os.path.getsize(os.path.join(last, name)) for name in os.listdir(last))
    shutil.rmtree(checkpoints)
    with_fsync, without = statistics.median(times[True]), statistics.median(times[False])
    return {"bytes": size, "fsync_s": with_fsync, "no_fsync_s": without,
            "fsyncs_alone_s": statistics.median(syncs), "ratio": with_fsync / without,
            "rounds": {"fsync": times[True], "no_fsync": times[False],
                       "fsync_rounds_writes": writes, "fsync_rounds_fsyncs": syncs}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--folder", default=os.path.join(ROOT, "build", "bench-checkpoint-fsync"))
    p.add_argument("--sizes", default=",".join(PARAMETERS),
                   help=f"of {', '.join(PARAMETERS)}")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = sorted(set(sizes) - set(PARAMETERS))
    if unknown:
        p.error(f"--sizes: {', '.join(unknown)} unknown; the sizes are {', '.join(PARAMETERS)}")
    os.makedirs(args.folder, exist_ok=True)
    where = filesystem(args.folder)
    print(f"{args.folder}: {where}; median of {args.rounds} rounds each, taking turns; each "
          "round starts with no dirty pages (os.sync)")
    if where.startswith("tmpfs"):
        print("tmpfs: the page cache is the storage, an fsync does nothing")
    print(f"{'size':10} {'MB':>6} {'no fsync s':>11} {'MB/s':>7} {'fsync s':>9} {'MB/s':>7} "
          f"{'fsyncs s':>9} {'fsync / no':>11}")
    results = {}
    for name in sizes:
        row = measure(os.path.join(args.folder, "checkpoints"), PARAMETERS[name], args.rounds)
        results[name] = row
        megabytes = row["bytes"] / 1e6
        print(f"{name:10} {megabytes:6.0f} {row['no_fsync_s']:11.3f} "
              f"{megabytes / row['no_fsync_s']:7.0f} {row['fsync_s']:9.3f} "
              f"{megabytes / row['fsync_s']:7.0f} {row['fsyncs_alone_s']:9.3f} "
              f"{row['ratio']:11.2f}")
    if args.json:
        write_atomically(args.json, json.dumps({"folder": args.folder, "filesystem": where,
                                                "sizes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
