"""Time, memory and precision of near-duplicate removal (data_prep/near.py) at corpus scale: across
folders (data_prep/across.py: `tupe-prep merge`, `--dedup-against`) and within a run
(data_prep/dedup.py's Deduplicator, --within).

Writes SHARDS synthetic shard folders of DOCUMENTS documents in all (train split only), each a set
of shingle hashes written as tupe-prep writes them (content keys, signatures, shingles, band
index). Web-like (--boilerplate B): every page holds one of --templates blocks of B shingles
(navigation, footer) and --unique shingles of its own, so pages of one template are alike at
Jaccard B / (B + 2U) (0.75 by default: below the threshold 0.8) and fall into their template's
LSH buckets by the thousand. Slotted (--slots S --slot-values V): S of the block's shingles vary,
each page taking one of V values for each (a date, a category), so a template's buckets are many
and fill at different sizes. Planted (--planted share of the documents of each later shard):
near-copies of a page of shard 0 at each Jaccard of --levels, exactly. Then, in a fresh process,
runs across.duplicates over them: time, the process's peak resident memory (VmHWM, memory-mapped
file pages included; its own: ru_maxrss would carry the parent's peak across exec) and how much of
it came after the imports, the peak of numpy's allocations (tracemalloc) and that in bytes a
document, and per Jaccard level the share of planted copies removed and the share that share an
LSH band with their source (what the LSH alone finds), and how many unplanted pages went (all of
them below the threshold).

    .venv/bin/python bench/dedup_across.py --documents 1000000 --shards 10 --folder /tmp/dd
    .venv/bin/python bench/dedup_across.py --within --documents 20000 --folder /tmp/dd-within
    .venv/bin/python bench/dedup_across.py --within --documents 60000 --shards 2 --slots 6 \
        --slot-values 3 --planted 0.1 --levels 0.75,0.82,0.85,0.9 --folder /tmp/dd-slots

Signatures are computed here a batch at a time (the template's minimum once per template), with
datasketch's affine32 permutations and hash mixing: the same values data_prep/near.py's
`signature` gives one document at a time (tests/test_data_prep.py checks it).
"""

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep import across, band_index, near  # noqa: E402

THRESHOLD, NUM_PERM = 0.8, 128
LEVELS = (0.6, 0.65, 0.7, 0.75, 0.85, 0.9, 0.95)


def signatures(hashes: np.ndarray, num_perm: int = NUM_PERM) -> np.ndarray:
    """[n, num_perm] uint32 MinHash signatures of n sets of shingle hashes ([n, k] uint32), as
    data_prep.near.signature gives them."""
    from datasketch.minhash import _fmix  # the library's own mixing, so that values agree

    a, b = near._sketch(num_perm).permutations
    mixed = _fmix(np.asarray(hashes, dtype=np.uint32), 32)
    with np.errstate(over="ignore"):
        return (mixed[:, :, None] * a[None, None, :] + b[None, None, :]).min(axis=1)


def copy_at(rng, page: np.ndarray, jaccard: float) -> np.ndarray:
    """A copy of a page's shingles with r of them replaced, so that page and copy are at
    `jaccard` exactly (to the nearest shingle): shared T - r, union T + r."""
    replaced = int(round(len(page) * (1 - jaccard) / (1 + jaccard)))
    copy = page.copy()
    copy[rng.choice(len(page), size=replaced, replace=False)] = rng.integers(
        0, 2**32, size=replaced, dtype=np.uint32)
    return copy


def filled_blocks(blocks: np.ndarray, slot_values: np.ndarray, template: np.ndarray,
                  choice: np.ndarray) -> np.ndarray:
    """Each page's template block ([pages, boilerplate]), its last `slots` shingles those of the
    slot values it chose (choice [pages, slots] indexes slot_values[template, slot])."""
    filled = blocks[template]
    slots = choice.shape[1]
    if slots:
        filled[:, -slots:] = slot_values[template[:, None], np.arange(slots), choice]
    return filled


def pages(rng, count: int, args, blocks: np.ndarray, slot_values: np.ndarray, first_shard=None):
    """(own shingles [count, unique], each page's template, its slot choices [count, slots],
    planted copies: row -> its whole shingle set, and (row, source row, Jaccard) of each)."""
    own = rng.integers(0, 2**32, size=(count, args.unique), dtype=np.uint32)
    template = rng.integers(0, max(1, args.templates), size=count)
    choice = rng.integers(0, slot_values.shape[2], size=(count, slot_values.shape[1]))
    copies, planted = {}, []
    if first_shard is not None:
        rows = rng.choice(count, size=int(args.planted * count), replace=False)
        for row, level in zip(rows.tolist(), np.resize(args.levels, len(rows))):
            source = int(rng.integers(0, len(first_shard[0])))
            first_own, first_template, first_choice = first_shard
            page = np.concatenate([filled_blocks(blocks, slot_values, first_template[[source]],
                                                 first_choice[[source]])[0], first_own[source]])
            copies[row] = copy_at(rng, page, level)
            shared = len(np.intersect1d(page, copies[row]))
            planted.append((row, source, shared / (2 * len(page) - shared)))
    return own, template, choice, copies, planted


def write_shard(prefix: str, own: np.ndarray, template: np.ndarray, choice: np.ndarray,
                copies: dict, blocks: np.ndarray, slot_values: np.ndarray, rng,
                chunk: int = 1 << 14) -> None:
    """The files tupe-prep writes for near-duplicate removal: pages of `own` shingles and
    their template's block (blocks[template], possibly 0 wide, its slots filled by `choice`),
    or for the rows of `copies` the shingles given there."""
    count, slots = len(own), choice.shape[1]
    fixed = blocks[:, :blocks.shape[1] - slots]
    block_min = signatures(fixed) if fixed.shape[1] else None
    slot_min = signatures(slot_values.reshape(-1, 1)).reshape(*slot_values.shape, NUM_PERM)
    sig = np.lib.format.open_memmap(f"{prefix}.{across.SIGNATURES}", mode="w+", dtype=np.uint32,
                                    shape=(count, NUM_PERM))
    for start in range(0, count, chunk):
        part = signatures(own[start:start + chunk])
        rows = slice(start, start + chunk)
        if block_min is not None:
            part = np.minimum(part, block_min[template[rows]])
        if slots:
            part = np.minimum(part, slot_min[template[rows, None], np.arange(slots),
                                             choice[rows]].min(axis=1))
        sig[rows] = part
    for row, page in copies.items():
        sig[row] = signatures(page[None])[0]
    sig.flush()

    def shingles():
        for start in range(0, count, chunk):
            rows = slice(start, start + chunk)
            whole = np.sort(np.concatenate([filled_blocks(blocks, slot_values, template[rows],
                                                          choice[rows]), own[rows]], axis=1),
                            axis=1)
            for row, values in enumerate(whole, start):
                yield np.sort(copies[row]) if row in copies else values

    # random hashes: distinct within a page but by a one-in-a-million chance
    near.write_shingles(prefix, shingles(), count * (blocks.shape[1] + own.shape[1]), count)
    band_index.write_band_index(prefix, sig, THRESHOLD, NUM_PERM)
    np.save(f"{prefix}.keys.npy", rng.integers(0, 2**63, size=count, dtype=np.uint64))


def make(args) -> dict:
    rng = np.random.default_rng(args.seed)
    blocks = rng.integers(0, 2**32, size=(max(1, args.templates), args.boilerplate),
                          dtype=np.uint32)
    slot_values = rng.integers(0, 2**32, size=(max(1, args.templates), args.slots,
                                               args.slot_values), dtype=np.uint32)
    bounds = np.linspace(0, args.documents, args.shards + 1).astype(np.int64)
    started, first_shard, planted = time.perf_counter(), None, []
    for shard in range(args.shards):
        own, template, choice, copies, planted_here = pages(
            rng, int(bounds[shard + 1] - bounds[shard]), args, blocks, slot_values, first_shard)
        if shard == 0:
            first_shard = (own, template, choice)
        planted += [(shard, *row) for row in planted_here]
        prefix = os.path.join(args.folder, f"shard{shard}", "train")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        write_shard(prefix, own, template, choice, copies, blocks, slot_values, rng)
        print(f"shard {shard}: {len(own):,} documents ({time.perf_counter() - started:.0f} s)",
              flush=True)
    with open(os.path.join(args.folder, "planted.json"), "w") as f:
        json.dump(planted, f)
    return {"documents": args.documents, "shards": args.shards, "planted": len(planted),
            "bands_rows": near.lsh_shape(THRESHOLD, NUM_PERM),
            "make_seconds": round(time.perf_counter() - started, 1)}


def removal_by_level(folder: str, removed: list) -> dict:
    """Per planted Jaccard level: (removed, planted); per level, the planted copies that share an
    LSH band with their source (what the LSH alone finds); and the unplanted pages removed."""
    with open(os.path.join(folder, "planted.json")) as f:
        planted = json.load(f)
    bands, rows = near.lsh_shape(THRESHOLD, NUM_PERM)
    signatures = [across.Part(os.path.join(folder, f"shard{shard}", "train")).signatures()
                  for shard in range(len(removed))]
    levels, lsh, planted_rows = {}, {}, set()
    for shard, row, source, jaccard in planted:
        level = levels.setdefault(f"{jaccard:.2f}", [0, 0])
        level[0] += bool(removed[shard][row])
        level[1] += 1
        found = lsh.setdefault(f"{jaccard:.2f}", [0, 0])
        pair = near.band_keys(np.stack([signatures[shard][row], signatures[0][source]]), bands,
                              rows)
        found[0] += bool((pair[:, 0] == pair[:, 1]).any())
        found[1] += 1
        planted_rows.add((shard, row))
    others = sum(int(gone[row]) for shard, gone in enumerate(removed)
                 for row in np.flatnonzero(gone) if (shard, row) not in planted_rows)
    return {"by_level": dict(sorted(levels.items())), "lsh_by_level": dict(sorted(lsh.items())),
            "unplanted_removed": others}


def resident_gb(field: str) -> float:
    """This process's VmRSS (now) or VmHWM (its peak) from /proc/self/status, in GB."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
    return kib / 2**20


def measure(folder: str, shards: int) -> dict:
    parts = [across.Part(os.path.join(folder, f"shard{shard}", "train"))
             for shard in range(shards)]
    documents = sum(len(part.keys()) for part in parts)
    after_imports = resident_gb("VmRSS")
    tracemalloc.start()
    started = time.perf_counter()
    removed = across.duplicates(parts, THRESHOLD, NUM_PERM)
    seconds = time.perf_counter() - started
    _, traced_peak = tracemalloc.get_traced_memory()
    peak = resident_gb("VmHWM")
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(peak, 2),
            "rss_above_imports_gb": round(peak - after_imports, 2),
            "numpy_peak_gb": round(traced_peak / 2**30, 3),
            "numpy_peak_bytes_per_document": round(traced_peak / max(1, documents), 1),
            **removal_by_level(folder, [r.near for r in removed])}


def measure_within(folder: str) -> dict:
    """The shards' pages, in order, through one Deduplicator (one prep run's stage)."""
    from data_prep.dedup import KEPT, Deduplicator
    from data_prep.workers import PASS1_BATCH_DOCS

    os.makedirs(os.path.join(folder, "dedup"), exist_ok=True)
    dedup = Deduplicator("minhash", THRESHOLD, NUM_PERM, os.path.join(folder, "dedup"))
    removed, started = [], time.perf_counter()
    shard = 0
    while os.path.exists(os.path.join(folder, f"shard{shard}")):
        part = across.Part(os.path.join(folder, f"shard{shard}", "train"))
        sig, shingles = part.signatures(), near.ShingleFile(part.prefix)
        keys, verdicts = part.keys(), []
        for start in range(0, len(keys), PASS1_BATCH_DOCS):  # as prep's batches come
            rows = range(start, min(start + PASS1_BATCH_DOCS, len(keys)))
            verdicts += dedup.judge(keys[start:rows.stop], np.asarray(sig[start:rows.stop]),
                                    [shingles[row] for row in rows])
        removed.append(np.array([verdict != KEPT for verdict in verdicts]))
        shard += 1
    return {"seconds": round(time.perf_counter() - started, 1),
            "peak_rss_gb": round(resident_gb("VmHWM"), 2),
            **removal_by_level(folder, removed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--boilerplate", type=int, default=120,
                        help="shingles of the block shared by a template's pages (0: none)")
    parser.add_argument("--templates", type=int, default=10)
    parser.add_argument("--slots", type=int, default=0,
                        help="shingles of the block that vary: each page takes one of "
                             "--slot-values values for each (dates, names, categories)")
    parser.add_argument("--slot-values", type=int, default=1)
    parser.add_argument("--unique", type=int, default=20, help="shingles of each page's own")
    parser.add_argument("--planted", type=float, default=0.01,
                        help="share of each later shard planted as near-copies of shard 0's")
    parser.add_argument("--levels", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(LEVELS), help="Jaccard levels of the planted copies")
    parser.add_argument("--within", action="store_true",
                        help="one Deduplicator over every page in order, not across.duplicates")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        result = measure_within(args.folder) if args.within else measure(args.folder, args.shards)
        print(json.dumps(result))
        return
    made = make(args)
    command = [sys.executable, __file__, "--measure-only", "--folder", args.folder, "--shards",
               str(args.shards)] + ["--within"] * args.within
    measured = json.loads(subprocess.run(command, capture_output=True, text=True, check=True)
                          .stdout.strip().splitlines()[-1])
    print(json.dumps({**made, **measured}, indent=1))
    curve = ", ".join(f"J {level}: {gone}/{count} (LSH alone {found})"
                      for (level, (gone, count)), (found, _)
                      in zip(measured["by_level"].items(), measured["lsh_by_level"].values()))
    print(f"{args.documents:,} pages ({args.boilerplate} boilerplate ({args.slots} slots of "
          f"{args.slot_values} values) + {args.unique} own shingles, {args.templates} templates) "
          f"in {args.shards} shards, "
          f"{'within one run' if args.within else 'across.duplicates'}: {measured['seconds']} s "
          f"({args.documents / max(measured['seconds'], 0.1):,.0f} pages/s), "
          f"peak resident {measured['peak_rss_gb']} GB"
          + (f" (numpy {measured['numpy_peak_bytes_per_document']} B a document)"
             if "numpy_peak_bytes_per_document" in measured else "")
          + f"; planted removed: {curve}; "
          f"unplanted removed: {measured['unplanted_removed']}")


if __name__ == "__main__":
    main()
