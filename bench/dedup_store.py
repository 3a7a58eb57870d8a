"""The within-run de-duplicator's key store (data_prep/spill.py's KeyStore, on sqlite3) on a
replay of prep's calls: time, peak memory and disk (issue 58, item 3). At 6a4ad5b this bench also
ran the hand-written sorted runs (KeyRuns) KeyStore replaced, on the same replay, with parity of
every lookup; the figures and the decision are in bench/README.md.

The replay is Deduplicator.judge itself (data_prep/dedup.py), a batch of PASS1_BATCH_DOCS pages
at a time as prep calls it, on its two stores, `seen` (exact keys) and `buckets` (LSH band keys
tagged with their band), so each store sees exactly prep's calls: per batch one `in_runs` of the
exact keys and one of all tagged band keys; per page the exact check against the runs and
`.recent`, `add`, the bucket candidates from the runs and `.recent`, `add_below` for a kept page;
`settle` of both at the batch's end. Only the two checks that need signatures and shingles are
decided by the generated pages instead (no MinHash, no text: the store is what is measured).

Pages are key streams, a function of (seed, page) (tupe_ds/data/counter_random.py), so any page
can be rebuilt without keeping the stream: per page an exact key and `bands` band keys
(lsh_shape(0.8, 128), prep's defaults: 18 bands of 7 rows). Shaped like dedup_across.py's
web-like pages: each page belongs to a template (a site: one per --pages-per-template pages)
whose 120 boilerplate shingles of the page's 140 hold all 7 minima of a band with chance
(6/7)^7 = 0.34, and then the band's key is the template's (its buckets fill to
the bucket bound at once and are asked for ever after); its other bands are its own.
--exact-share of the pages are exact copies of an earlier page, --near-share near copies of an
earlier original page at one of dedup_across.py's Jaccard levels, sharing each of its band keys
with chance J^7 (the LSH's chance for a band at Jaccard J). A near copy at or above the threshold
is judged a duplicate when its source is among its candidates, as the true-Jaccard check would.
10% and 10% by default: more than dedup_across.py's 1% planted copies, so that exact hits, bucket
hits and full buckets all come often; a web crawl's share is of that order or more.

Each store runs in its own process, the stores taking turns (--rounds): wall and CPU seconds of
the replay, the CPU seconds in `in_runs` and `settle`, peak RSS (the process's own, VmHWM;
sqlite's reads through the page cache do not count), the work folder's bytes at the end and the
entries stored. Parity: the verdicts, the entries and every lookup's answer must be the same in
every round, else the run fails.

    .venv/bin/python bench/dedup_store.py --pages 100000 --rounds 2
    nice -n 5 .venv/bin/python bench/dedup_store.py --pages 10000000 --json /tmp/dedup-10m.json
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zlib

import numpy as np
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep.config import PrepConfig  # noqa: E402
from data_prep.dedup import EXACT, KEPT, NEAR, Deduplicator  # noqa: E402
from data_prep.near import WITHIN_RUN_CANDIDATES_PER_BUCKET, lsh_shape  # noqa: E402
from data_prep.spill import KeyStore  # noqa: E402
from tupe_ds.data.counter_random import bits, sample_keys, uniform  # noqa: E402

THRESHOLD, NUM_PERM = PrepConfig.jaccard_threshold, PrepConfig.num_perm
BANDS, ROWS = lsh_shape(THRESHOLD, NUM_PERM)
LEVELS = np.array([0.6, 0.65, 0.7, 0.75, 0.85, 0.9, 0.95])  # dedup_across.py's planted levels
TEMPLATE_SHARE = (120 / 140) ** ROWS  # dedup_across.py's pages: 120 boilerplate + 20 own shingles
ORIGINAL, EXACT_COPY, NEAR_COPY = 0, 1, 2
CACHE_KIB = 64 * 1024  # sqlite's page cache per store
GENERATED_BATCHES = 1024  # batches of pages generated at once


STORES = {"sqlite": KeyStore}


def timed(store_class):
    """store_class whose `in_runs` and `settle` add their CPU seconds to `.seconds`, and whose
    answers go into `.crc` (for the parity check, outside the timing)."""

    class Timed(store_class):
        seconds, crc = 0.0, 0

        def in_runs(self, keys):
            started = time.process_time()
            queries, values = super().in_runs(keys)
            Timed.seconds += time.process_time() - started
            Timed.crc = zlib.crc32(np.asarray(values, np.uint32).tobytes(), zlib.crc32(
                np.asarray(queries, np.int64).tobytes(), Timed.crc))
            return queries, values

        def settle(self):
            started = time.process_time()
            super().settle()
            Timed.seconds += time.process_time() - started

    return Timed


class Pages:
    """The generated pages of one run: kind, source, template and keys of any page by number."""

    def __init__(self, seed: int, pages: int, args):
        self.seed, self.pages = seed, pages
        self.templates = max(1, pages // args.pages_per_template)
        self.exact_share, self.near_share = args.exact_share, args.near_share

    def key(self, pages):
        return sample_keys(self.seed, 0, pages, 0)

    def kind(self, pages):
        u = uniform(self.key(pages), 0)
        kind = np.where(u < self.exact_share, EXACT_COPY,
                        np.where(u < self.exact_share + self.near_share, NEAR_COPY, ORIGINAL))
        return np.where(np.asarray(pages) == 0, ORIGINAL, kind)

    def earlier(self, pages):
        """A page drawn before each of `pages` (page 0: itself)."""
        pages = np.asarray(pages, np.int64)
        return (bits(self.key(pages), 1) % np.maximum(pages, 1).astype(np.uint64)).astype(np.int64)

    def source(self, pages, kinds_allowed):
        """Each page's earlier page, followed back until its kind is one of `kinds_allowed`."""
        source = self.earlier(pages)
        while True:
            back = ~np.isin(self.kind(source), kinds_allowed)
            if not back.any():
                return source
            source[back] = self.earlier(source[back])

    def own_bands(self, pages, templates):
        """[pages, BANDS] band keys of pages drawn as originals of `templates`."""
        keys = self.key(pages)[:, None]
        band = np.arange(BANDS)
        template_keys = bits(sample_keys(self.seed, 1, templates, 0)[:, None], band)
        return np.where(uniform(keys, 10 + band) < TEMPLATE_SHARE, template_keys,
                        bits(keys, 40 + band))

    def content_bands(self, pages) -> tuple:
        """(band keys [pages, BANDS], each page's original source, at or above the threshold)
        of pages that are originals or near copies."""
        kind = self.kind(pages)
        original_of = self.source(pages, [ORIGINAL])
        level = LEVELS[(bits(self.key(pages), 2) % np.uint64(len(LEVELS))).astype(np.int64)]
        template = np.where(kind == NEAR_COPY, original_of, pages)
        template = (bits(self.key(template), 3) % np.uint64(self.templates)).astype(np.int64)
        bands = self.own_bands(pages, template)
        near = np.flatnonzero(kind == NEAR_COPY)
        shared = uniform(self.key(pages[near])[:, None], 70 + np.arange(BANDS)) < (
            level[near, None] ** ROWS)
        bands[near] = np.where(shared, self.own_bands(original_of[near], template[near]),
                               bands[near])
        return bands, original_of, (kind == NEAR_COPY) & (level >= THRESHOLD)

    def batch(self, start: int, stop: int) -> dict:
        """Pages [start, stop): an exact copy has its source's exact key and band keys."""
        pages = np.arange(start, stop)
        kind = self.kind(pages)
        content = np.where(kind == EXACT_COPY, self.source(pages, [ORIGINAL, NEAR_COPY]), pages)
        bands, source, close = self.content_bands(content)
        return {"pages": pages, "kind": kind, "source": source, "bands": bands,
                "close": close & (kind == NEAR_COPY), "keys": bits(self.key(content), 4)}


class Replay(Deduplicator):
    """Deduplicator.judge on a store class, its `signatures` argument the pages' numbers: the
    two checks that would read signatures and shingles are decided by the generated pages."""

    def __init__(self, store_class, folder: str, pages: int, bucket_bound: int):
        self.mode, self.threshold = "minhash", THRESHOLD
        self.exact_removed = self.near_removed = self.kept = 0
        self.bands, self.rows = BANDS, ROWS
        self.seen, self.buckets = store_class(folder, "exact"), store_class(folder, "buckets")
        self.document_of = np.full(pages, -1, np.int32)  # a kept page's number in the store
        self.batch = None
        self.bucket_bound = bucket_bound

    def judge_batch(self, batch: dict) -> list:
        self.batch = batch
        no_shingles = np.zeros((len(batch["pages"]), 1), np.uint32)
        return self.judge(batch["keys"], batch["pages"], no_shingles, batch["bands"])

    def _near_copy(self, candidates, page, shingles) -> bool:
        at = page - self.batch["pages"][0]
        return bool(self.batch["close"][at]) and (
            self.document_of[self.batch["source"][at]] in candidates)

    def _add(self, tagged_keys, in_runs, page, shingles) -> None:
        self.document_of[page] = self.kept
        self.buckets.add_below(tagged_keys, in_runs.tolist(), self.kept, self.bucket_bound)
        self.kept += 1


def entries(store) -> int:
    return store.stored() + store.recent_entries


def peak_rss_kib() -> int:
    """This process's peak resident KiB (mapped file pages included): VmHWM, since getrusage's
    ru_maxrss keeps the parent's size at the fork that started this process."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def folder_bytes(folder: str) -> int:
    return sum(os.stat(os.path.join(folder, name)).st_blocks * 512 for name in os.listdir(folder))


def run_store(args) -> dict:
    """One store through the whole replay, in this process."""
    store_class = timed(STORES[args.child])
    pages = Pages(args.seed, args.pages, args)
    replay = Replay(store_class, args.folder, args.pages, args.bucket_bound)
    baseline_kib = peak_rss_kib()
    counts = {KEPT: 0, EXACT: 0, NEAR: 0}
    planted = {"exact copies": 0, "near copies": 0, "near copies >= threshold": 0}
    code = {KEPT: b"k", EXACT: b"e", NEAR: b"n"}
    crc, generating = 0, 0.0
    started, cpu_started = time.perf_counter(), time.process_time()
    with tqdm(total=args.pages, unit=" pages", mininterval=30, file=sys.stderr,
              desc=args.child) as progress:
        chunk = args.batch * GENERATED_BATCHES
        for start in range(0, args.pages, args.batch):
            if start % chunk == 0:
                began = time.perf_counter()
                generated = pages.batch(start, min(start + chunk, args.pages))
                generating += time.perf_counter() - began
            at = start % chunk
            batch = {name: column[at:at + args.batch] for name, column in generated.items()}
            verdicts = replay.judge_batch(batch)
            for verdict in verdicts:
                counts[verdict] += 1
            crc = zlib.crc32(b"".join(code[v] for v in verdicts), crc)
            planted["exact copies"] += int((batch["kind"] == EXACT_COPY).sum())
            planted["near copies"] += int((batch["kind"] == NEAR_COPY).sum())
            planted["near copies >= threshold"] += int(batch["close"].sum())
            progress.update(len(verdicts))
    seconds = time.perf_counter() - started
    return {"store": args.child, "pages": args.pages, "seconds": seconds,
            "cpu_seconds": time.process_time() - cpu_started,
            "replay_seconds": seconds - generating, "store_seconds": store_class.seconds,
            "peak_rss_mib": peak_rss_kib() / 1024,
            "baseline_rss_mib": baseline_kib / 1024, "disk_mib": folder_bytes(args.folder) / 2**20,
            "entries": {"exact": entries(replay.seen), "buckets": entries(replay.buckets)},
            "verdicts": counts, "verdict_crc32": crc, "lookups_crc32": store_class.crc,
            "planted": planted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=100_000)
    parser.add_argument("--stores", default="sqlite", help=f"of {', '.join(STORES)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each store, taking turns (each round starts with the next)")
    parser.add_argument("--work", default=None,
                        help="folder for the stores' files (default: a temporary one under "
                             "build/); each run's files are removed after it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exact-share", type=float, default=0.1)
    parser.add_argument("--near-share", type=float, default=0.1)
    parser.add_argument("--pages-per-template", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=None,
                        help="pages per judge call (default: prep's PASS1_BATCH_DOCS)")
    parser.add_argument("--bucket-bound", type=int, default=WITHIN_RUN_CANDIDATES_PER_BUCKET,
                        help="documents a bucket keeps (default: prep's within a run; the "
                             "figures in bench/README.md were taken at 8)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", choices=sorted(STORES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_store(args)))
        return
    if args.batch is None:
        with warnings.catch_warnings():  # the module imports megatron-core, which warns
            warnings.simplefilter("ignore")
            from data_prep.workers import PASS1_BATCH_DOCS
        args.batch = PASS1_BATCH_DOCS
    stores = args.stores.split(",")
    unknown = [store for store in stores if store not in STORES]
    if unknown:
        parser.error(f"--stores: unknown {', '.join(unknown)}; choose from {', '.join(STORES)}")
    if args.work is None:
        os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="dedup-store-", dir=args.work or os.path.join(ROOT, "build"))
    results = []
    try:
        for round_ in range(args.rounds):
            for store in stores[round_ % len(stores):] + stores[:round_ % len(stores)]:
                folder = os.path.join(work, f"{store}-{round_}")
                os.makedirs(folder)
                command = [sys.executable, os.path.abspath(__file__), "--child", store,
                           "--folder", folder, "--pages", str(args.pages), "--seed",
                           str(args.seed), "--batch", str(args.batch), "--exact-share",
                           str(args.exact_share), "--near-share", str(args.near_share),
                           "--pages-per-template", str(args.pages_per_template),
                           "--bucket-bound", str(args.bucket_bound)]
                out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(folder)
                print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    report(results, args)


def report(results: list, args) -> None:
    first = results[0]
    print(f"\n{args.pages:,} pages in batches of {args.batch}, seed {args.seed}: "
          f"{BANDS} bands x {ROWS} rows; planted {json.dumps(first['planted'])}")
    print("| store | round | wall s | CPU s | in_runs + settle CPU s | peak RSS MiB (before the "
          "store) | disk MiB | entries (exact + buckets) | kept / exact / near |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    stores = len({r["store"] for r in results})
    for i, r in enumerate(results):
        v = r["verdicts"]
        print(f"| {r['store']} | {i // stores} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} "
              f"| {r['store_seconds']:.1f} "
              f"| {r['peak_rss_mib']:,.0f} ({r['baseline_rss_mib']:,.0f}) "
              f"| {r['disk_mib']:,.0f} | {r['entries']['exact']:,} + {r['entries']['buckets']:,} "
              f"| {v[KEPT]:,} / {v[EXACT]:,} / {v[NEAR]:,} |")
    parity = [(r["verdicts"], r["verdict_crc32"], r["entries"], r["lookups_crc32"])
              for r in results]
    if any(p != parity[0] for p in parity):
        sys.exit("parity: FAIL, the stores differ in verdicts, entries or lookups' answers: "
                 + "; ".join(f"{r['store']} {p}" for r, p in zip(results, parity)))
    print(f"parity: every store gave the same verdicts (crc32 {first['verdict_crc32']}), "
          f"entries and answers to every lookup (crc32 {first['lookups_crc32']})")


if __name__ == "__main__":
    main()
