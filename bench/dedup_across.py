"""Time and memory of the de-duplication across folders (data_prep/across.py: `tupe-prep merge`,
`--dedup-against`) at BERT's corpus size.

Writes SHARDS synthetic shard folders of DOCUMENTS documents in all (train split only): random
128-value signatures, of which a share (--near) are near-copies of a document of an earlier
shard (--changed of their values redrawn: Jaccard about 1 - changed/128), with the keys and band
keys tupe-prep writes; then, in a fresh process, runs across.duplicates over them and prints the
time, the process's peak resident memory (ru_maxrss, memory-mapped file pages included) and the
peak of numpy's allocations (tracemalloc), against the band tables' 12 bytes x bands per document.

    .venv/bin/python bench/dedup_across.py --documents 10000000 --shards 10 --folder /tmp/dd
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep import across  # noqa: E402

THRESHOLD, NUM_PERM = 0.8, 128


def make(folder: str, documents: int, shards: int, near: float, changed: int, seed: int) -> dict:
    bands, rows = across.lsh_shape(THRESHOLD, NUM_PERM)
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, documents, shards + 1).astype(np.int64)
    planted, started = 0, time.perf_counter()
    first_shard = None
    for shard in range(shards):
        count = int(bounds[shard + 1] - bounds[shard])
        prefix = os.path.join(folder, f"shard{shard}", "train")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        signatures = rng.integers(0, 2**32, size=(count, NUM_PERM), dtype=np.uint32)
        if shard > 0:  # near-copies of documents of shard 0
            copies = rng.choice(count, size=int(near * count), replace=False)
            sources = rng.integers(0, len(first_shard), size=len(copies))
            signatures[copies] = first_shard[sources]
            redrawn = rng.integers(0, NUM_PERM, size=(len(copies), changed))
            signatures[copies[:, None], redrawn] = rng.integers(
                0, 2**32, size=redrawn.shape, dtype=np.uint32)
            planted += len(copies)
        else:
            first_shard = signatures
        np.save(f"{prefix}.{across.SIGNATURES}", signatures)
        np.save(f"{prefix}.{across.BANDS}", across.band_keys(signatures, bands, rows))
        np.save(f"{prefix}.keys.npy", rng.integers(0, 2**63, size=count, dtype=np.uint64))
        print(f"shard {shard}: {count:,} documents ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return {"documents": documents, "shards": shards, "planted": planted, "bands": bands,
            "rows": rows, "make_seconds": round(time.perf_counter() - started, 1)}


def measure(folder: str, shards: int) -> dict:
    parts = [across.Part(os.path.join(folder, f"shard{shard}", "train"))
             for shard in range(shards)]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    started = time.perf_counter()
    removed = across.duplicates(parts, THRESHOLD)
    seconds = time.perf_counter() - started
    _, traced_peak = tracemalloc.get_traced_memory()
    return {"seconds": round(seconds, 1), "near_removed": int(sum(r.near.sum() for r in removed)),
            "exact_removed": int(sum(r.exact.sum() for r in removed)),
            "peak_rss_gb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                  - baseline) / 2**20, 2),
            "numpy_peak_gb": round(traced_peak / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--near", type=float, default=0.01, help="share of near-copies planted")
    parser.add_argument("--changed", type=int, default=8, help="values redrawn in a copy")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.folder, args.shards)))
        return
    made = make(args.folder, args.documents, args.shards, args.near, args.changed, args.seed)
    result = subprocess.run([sys.executable, __file__, "--measure-only", "--folder", args.folder,
                             "--shards", str(args.shards)], capture_output=True, text=True,
                            check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    tables_gb = args.documents * made["bands"] * 12 / 2**30
    print(json.dumps({**made, **measured, "band_tables_gb": round(tables_gb, 2)}, indent=1))
    print(f"{args.documents:,} documents in {args.shards} shards: across.duplicates in "
          f"{measured['seconds']} s, peak resident {measured['peak_rss_gb']} GB (numpy "
          f"{measured['numpy_peak_gb']} GB; band tables {tables_gb:.2f} GB); found "
          f"{measured['near_removed']:,} of {made['planted']:,} planted near-copies")


if __name__ == "__main__":
    main()
