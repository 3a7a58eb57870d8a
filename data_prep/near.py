"""Near-duplicate detection shared by the within-run stage (dedup.py) and the one across
prepared folders (across.py): MinHash LSH finds candidates, and a candidate removes a document
only when their true Jaccard similarity, over the stored hashes of their word shingles, reaches
the threshold.

Why not datasketch's MinHashLSH alone: its queries return whole buckets, and web pages sharing
a navigation or footer block share buckets by the thousand, so the work grows with the square of
a bucket; and the signatures' agreement is only an estimate (affine32 signatures agree on 0.767
of their values on average where the true Jaccard is 0.7375), so a page with hundreds of
candidates below the threshold is removed almost surely. Here each bucket offers its
CANDIDATES_PER_BUCKET earliest documents (WITHIN_RUN_CANDIDATES_PER_BUCKET within one run), the
candidates whose signatures agree on at least the threshold less AGREEMENT_MARGIN are ranked by
agreement, and the VERIFIED_PER_DOCUMENT best are checked exactly: time and memory grow with the
number of documents whatever the buckets, and nothing below the threshold is ever removed. What
it may miss: a near-duplicate that shares with its document only buckets whose earliest
documents are others, as a templated page's copy may (docs/data.md gives the measured curve).
"""

import functools
import hashlib
import re

import numpy as np
from datasketch import MinHash

from data_prep.clean import without_format
from tupe_ds.data.counter_random import absorb

WORD = re.compile(r"\w+")
SCHEME = "affine32"  # named, so that signatures made in workers can be rebuilt anywhere
RECALL_AT_THRESHOLD = 0.98  # the LSH's chance of a candidate pair at exactly the threshold
CANDIDATES_PER_BUCKET = 8
# Only a template's buckets fill, and a templated page's copy that shares with its source nothing
# but such buckets is found only when the source is among their earliest: within a run a bucket
# keeps 128 (bench/dedup_across.py --slots 6: at Jaccard 0.85, 98.8-99.6% removed where the LSH
# finds 99.7-100%, against 98.4-99.1% at 8; up to twice the time). Its entries are at most one a
# kept document and band whatever the bound: the bound costs time (bands x bound candidates'
# signatures read a document), not memory.
WITHIN_RUN_CANDIDATES_PER_BUCKET = 128
VERIFIED_PER_DOCUMENT = 8
AGREEMENT_MARGIN = 0.15  # over 3 standard deviations of 128 values' agreement near 0.8
SHINGLES, SHINGLE_OFFSETS = "shingles.npy", "shingle_offsets.npy"


@functools.lru_cache(maxsize=8)
def lsh_shape(threshold: float, num_perm: int) -> tuple:
    """(bands, rows per band): the most rows (the fewest candidates) for which a pair at exactly
    `threshold` shares a band with probability RECALL_AT_THRESHOLD or more."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold ** rows) ** bands >= RECALL_AT_THRESHOLD:
            return bands, rows
    return num_perm, 1


@functools.lru_cache(maxsize=4)
def _sketch(num_perm: int) -> MinHash:
    """One MinHash per process and size, cleared for each document: drawing the permutations
    and building the object cost more than hashing a short page."""
    return MinHash(num_perm=num_perm, hashfunc=int, scheme=SCHEME)


def shingle_hashes(text: str, shingle: int) -> np.ndarray:
    """Sorted, distinct uint32 hashes of the text's lower-cased word `shingle`-grams, its
    invisible characters ignored (clean.without_format): the first 4 bytes of each one's SHA-1,
    little-endian (datasketch's sha1_hash32, without its call per gram)."""
    # no words: no shingle, so no near duplicate of anything
    words = WORD.findall(without_format(text).lower())
    grams = {" ".join(words[i:i + shingle]) for i in range(max(1 if words else 0,
                                                                len(words) - shingle + 1))}
    digests = b"".join(hashlib.sha1(g.encode("utf-8")).digest()[:4] for g in grams)
    return np.unique(np.frombuffer(digests, dtype="<u4")).astype(np.uint32)


def signature(hashes: np.ndarray, num_perm: int) -> np.ndarray:
    """The MinHash signature (uint32) of a document's shingle hashes."""
    sketch = _sketch(num_perm)
    sketch.clear()
    sketch.update_batch(hashes.tolist())
    return sketch.hashvalues.astype(np.uint32)


def band_keys(signatures: np.ndarray, bands: int, rows: int, chunk: int = 1 << 16) -> np.ndarray:
    """[bands, documents] uint64: band j's key hashes signature values [j*rows, (j+1)*rows)."""
    keys = np.empty((bands, len(signatures)), dtype=np.uint64)
    for start in range(0, len(signatures), chunk):
        block = np.asarray(signatures[start:start + chunk], dtype=np.uint64)
        block = block[:, :bands * rows].reshape(len(block), bands, rows)
        key = np.zeros((len(block), bands), dtype=np.uint64)
        for column in range(rows):
            key = absorb(key, block[:, :, column])
        keys[:, start:start + len(block)] = key.T
    return keys


def jaccards(first: tuple, second: tuple) -> np.ndarray:
    """The Jaccard similarity of each pair of hash sets, given as (values, lengths): the pairs'
    first sets one after another, and their second sets (each set sorted and distinct). All
    pairs at once: tagged with its pair's number, each side is one sorted array, and the first
    side's values are looked up in the second's."""
    (a, a_lengths), (b, b_lengths) = first, second
    pairs = len(a_lengths)
    if not pairs:
        return np.zeros(0)
    tagged_a, tagged_b = (
        (np.repeat(np.arange(pairs, dtype=np.uint64), lengths) << np.uint64(32))
        | np.asarray(values, dtype=np.uint64) for values, lengths in ((a, a_lengths), (b, b_lengths)))
    found = np.minimum(np.searchsorted(tagged_b, tagged_a), len(tagged_b) - 1)
    equal = tagged_a[tagged_b[found] == tagged_a] if len(tagged_b) else tagged_a[:0]
    shared = np.bincount((equal >> np.uint64(32)).astype(np.int64), minlength=pairs)
    return shared / np.maximum(1, np.asarray(a_lengths) + np.asarray(b_lengths) - shared)


def to_verify(document: np.ndarray, agreement: np.ndarray, threshold: float) -> np.ndarray:
    """Indices of the pairs to check exactly: per document, its VERIFIED_PER_DOCUMENT pairs of
    highest agreement among those agreeing on threshold - AGREEMENT_MARGIN or more."""
    close = np.flatnonzero(agreement >= threshold - AGREEMENT_MARGIN)
    order = close[np.lexsort((-agreement[close], document[close]))]
    ranked = document[order]
    starts = np.searchsorted(ranked, ranked, side="left")
    return order[np.arange(len(order)) - starts < VERIFIED_PER_DOCUMENT]


class ShingleFile:
    """PREFIX.shingles.npy (every document's hashes, one after another) and
    PREFIX.shingle_offsets.npy (document i's are [offsets[i], offsets[i + 1])), memory-mapped."""

    def __init__(self, prefix: str):
        self.hashes = np.load(f"{prefix}.{SHINGLES}", mmap_mode="r")
        self.offsets = np.load(f"{prefix}.{SHINGLE_OFFSETS}", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, document: int) -> np.ndarray:
        return np.asarray(self.hashes[self.offsets[document]:self.offsets[document + 1]])

    def gather(self, documents: np.ndarray) -> tuple:
        """(values, lengths): the hashes of `documents`, one after another."""
        starts = np.asarray(self.offsets[documents])
        lengths = np.asarray(self.offsets[documents + 1]) - starts
        at = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(lengths.sum())
        return np.asarray(self.hashes[at]), lengths


def write_shingles(prefix: str, documents, total: int, count: int) -> None:
    """PREFIX.shingles.npy and .shingle_offsets.npy from `documents`, an iterable of `count`
    hash arrays of `total` hashes in all, streamed into memory-mapped files."""
    hashes = np.lib.format.open_memmap(f"{prefix}.{SHINGLES}", mode="w+", dtype=np.uint32,
                                       shape=(total,))
    offsets = np.zeros(count + 1, dtype=np.int64)
    written = 0
    for values in documents:
        offsets[written + 1] = offsets[written] + len(values)
        hashes[offsets[written]:offsets[written + 1]] = values
        written += 1
    if (written, offsets[-1]) != (count, total):
        raise AssertionError(f"{prefix}: {written} documents of {offsets[written]} shingle "
                             f"hashes written, {count} of {total} expected")
    hashes.flush()
    del hashes
    np.save(f"{prefix}.{SHINGLE_OFFSETS}", offsets)
