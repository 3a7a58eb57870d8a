"""What a checkpoint's manifest costs: checksumming BERT-Large's checkpoint with its optimizer
state, next to the save it follows.

BERT-Large (335M parameters) under mixed-precision Adam saves fp16 weights (2 bytes a parameter,
mp_rank_00_model_states.pt) and fp32 master weights with two Adam moments (12 bytes a parameter,
split over the data-parallel ranks' optimizer shards): about 4.7 GB. The script writes --gigabytes
of real torch files (torch.save of random fp32 tensors, 256 MB each) and times, best of
--repeats, on the same files in one run:
  - torch.save of them (the save the checksums follow);
  - tupe_ds's checksum (xxh3-128, `tupe_ds.train.checkpoint.manifest.checksum`);
  - sha256 and crc32 streamed the same way (the alternatives);
  - the whole verification at resume (`manifest.check_files`: size, checksum and the
    weights_only read of each pickle, memory-mapped).
The files are read warm, from the page cache: a cold read is bound by the disk or filesystem,
which no checksum can beat. Figures are extrapolated linearly to BERT-Large's 4.7 GB, on one rank
and per rank when 8 data-parallel ranks share the files (as they do: each rank checksums what it
wrote, and verifies a share at resume).

    python bench/checkpoint_checksum.py [--gigabytes 1] [--repeats 3] [--dir /tmp] [--json F]
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tupe_ds.tools.third_party_warnings  # noqa: F401,E402  (first: filters import warnings)
from tupe_ds.train.checkpoint import manifest  # noqa: E402

BERT_LARGE_BYTES = 335e6 * (2 + 12)
FILE_BYTES = 256 << 20


def streamed(make, path):
    digest = make()
    with open(path, "rb") as f:
        while block := f.read(manifest.CHUNK):
            digest.update(block)
    return digest


class Crc32:
    def __init__(self):
        self.value = 0

    def update(self, block):
        self.value = zlib.crc32(block, self.value)


def best_of(repeats, work):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gigabytes", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    count = max(1, round(args.gigabytes * 1e9 / FILE_BYTES))
    torch.manual_seed(0)
    tensors = [torch.randn(FILE_BYTES // 4) for _ in range(count)]
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        paths = [os.path.join(folder, f"shard{i}.pt") for i in range(count)]
        names = [os.path.basename(path) for path in paths]

        def save():
            for tensor, path in zip(tensors, paths):
                torch.save({"state": tensor}, path)

        seconds = {"torch.save": best_of(args.repeats, save)}
        size = sum(os.path.getsize(path) for path in paths)
        expected = manifest.describe(folder, names)
        seconds["xxh3-128 (tupe_ds)"] = best_of(args.repeats, lambda: manifest.describe(
            folder, names))
        seconds["sha256"] = best_of(args.repeats, lambda: [streamed(hashlib.sha256, path)
                                                           for path in paths])
        seconds["crc32"] = best_of(args.repeats, lambda: [streamed(Crc32, path)
                                                          for path in paths])
        seconds["verification at resume"] = best_of(
            args.repeats, lambda: manifest.check_files(folder, expected))
        assert manifest.check_files(folder, expected) == []
    scale = BERT_LARGE_BYTES / size
    print(f"{size / 1e9:.2f} GB in {count} torch files, warm; BERT-Large's checkpoint "
          f"({BERT_LARGE_BYTES / 1e9:.1f} GB) extrapolated linearly")
    print(f"{'':24} {'GB/s':>7} {'BERT-Large, 1 rank':>19} {'per rank of 8':>14}")
    rows = {}
    for name, value in seconds.items():
        rows[name] = {"gb_per_s": size / value / 1e9, "bert_large_s": value * scale,
                      "bert_large_s_per_rank_of_8": value * scale / 8}
        print(f"{name:24} {rows[name]['gb_per_s']:7.2f} {value * scale:18.1f}s "
              f"{value * scale / 8:13.2f}s")
    ratios = {"xxh3 / torch.save": seconds["xxh3-128 (tupe_ds)"] / seconds["torch.save"],
              "sha256 / torch.save": seconds["sha256"] / seconds["torch.save"],
              "sha256 / xxh3": seconds["sha256"] / seconds["xxh3-128 (tupe_ds)"],
              "verification / torch.save": seconds["verification at resume"]
              / seconds["torch.save"]}
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": size, "rows": rows, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
