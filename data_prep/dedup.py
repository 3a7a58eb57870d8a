"""Stage 2, de-duplication of documents: exact (hash of the cleaned text), then near duplicates
(data_prep/near.py: LSH candidates, checked on the true Jaccard of their shingles)."""

import hashlib
import os

import numpy as np

from data_prep.clean import without_format
from data_prep.near import (WITHIN_RUN_CANDIDATES_PER_BUCKET, band_keys, jaccards, lsh_shape,
                            to_verify)
from data_prep.spill import KeyStore, Records
from tupe_ds.data.counter_random import absorb

KEPT, EXACT, NEAR = "kept", "exact", "near"


def exact_key(text: str) -> int:
    """64-bit hash of the cleaned text (whitespace and case as cleaned) without its invisible
    characters (the joiners, bidi controls and variation selectors that cleaning keeps:
    data_prep/clean.py)."""
    return int.from_bytes(hashlib.blake2b(without_format(text).encode("utf-8"),
                                          digest_size=8).digest(), "little")


class Deduplicator:
    """Keeps the first of each group of duplicates, in input order, a batch of documents at a
    time.

    mode: "exact", "minhash" (exact first, then near duplicates: a document goes when its true
    shingle Jaccard with a kept one reaches `threshold`), "none". Its state is in files in
    `folder` (data_prep/spill.py), so its memory does not grow with the documents: the exact
    keys seen, and with minhash the kept documents' signatures (SIGNATURES, in order: prep
    publishes them), shingle hashes (SHINGLES, read back only to check candidates) and LSH
    buckets, each of which holds at most WITHIN_RUN_CANDIDATES_PER_BUCKET of them.
    """

    SIGNATURES, SHINGLES = "signatures.spool", "shingles.spool"

    def __init__(self, mode: str = "minhash", threshold: float = 0.8, num_perm: int = 128,
                 folder: str = None):
        self.mode = mode
        self.threshold = threshold
        self.exact_removed = 0
        self.near_removed = 0
        self.kept = 0
        if mode == "none":
            return
        self.seen = KeyStore(folder, "exact")
        if mode == "minhash":
            self.bands, self.rows = lsh_shape(threshold, num_perm)
            self.buckets = KeyStore(folder, "buckets")  # keys: band keys tagged with their band
            self.signatures = Records(os.path.join(folder, self.SIGNATURES), np.uint32,
                                      (num_perm,))
            self.shingle_ends = Records(os.path.join(folder, "shingle_ends.spool"), np.int64)
            self.shingles = open(os.path.join(folder, self.SHINGLES), "w+b", buffering=0)
            self.shingle_total = 0

    def judge(self, keys, signatures=None, shingles=None, bands=None) -> list:
        """KEPT, EXACT or NEAR for each document of a batch, in order: `keys` their exact keys,
        with minhash `signatures` ([documents, num_perm]), `shingles` (each one's hashes) and
        optionally `bands` ([documents, bands], band_keys of the signatures)."""
        if self.mode == "none":
            self.kept += len(keys)
            return [KEPT] * len(keys)
        keys = np.asarray(keys, np.uint64)
        seen_before = np.zeros(len(keys), bool)
        seen_before[self.seen.in_runs(keys)[0]] = True
        near = self.mode == "minhash" and len(keys)
        if near:
            if bands is None:
                bands = band_keys(np.asarray(signatures), self.bands, self.rows).T
            tagged = absorb(np.asarray(bands, np.uint64), np.arange(self.bands))
            queries, members = self.buckets.in_runs(tagged.ravel())
            counts = np.bincount(queries, minlength=tagged.size).reshape(tagged.shape)
            starts = np.searchsorted(queries // self.bands, np.arange(len(keys) + 1))
            recent = self.buckets.recent
        verdicts = []
        for i, key in enumerate(keys.tolist()):
            if seen_before[i] or key in self.seen.recent:
                self.exact_removed += 1
                verdicts.append(EXACT)
                continue
            self.seen.add(key, 0)
            if not near:
                self.kept += 1
                verdicts.append(KEPT)
                continue
            own_keys = tagged[i].tolist()
            older = members[starts[i]:starts[i + 1]]
            candidates = [d for k in own_keys for d in recent.get(k, ())]
            own = np.asarray(shingles[i], np.uint32)
            if (candidates or len(older)) and self._near_copy(
                    np.unique(np.concatenate([older, candidates]).astype(np.int64)),
                    signatures[i], own):
                self.near_removed += 1
                verdicts.append(NEAR)
                continue
            self._add(own_keys, counts[i], signatures[i], own)
            verdicts.append(KEPT)
        self.seen.settle()
        if near:
            self.buckets.settle()
        return verdicts

    def _near_copy(self, candidates: np.ndarray, signature, shingles: np.ndarray) -> bool:
        agreement = (self.signatures[candidates] == signature).mean(axis=1)
        checked = candidates[to_verify(np.zeros(len(candidates), np.int64), agreement,
                                       self.threshold)]
        if not len(checked):
            return False
        theirs = [self.shingles_of(int(document)) for document in checked]
        return jaccards((np.tile(shingles, len(checked)), np.full(len(checked), len(shingles))),
                        (np.concatenate(theirs), [len(t) for t in theirs])
                        ).max() >= self.threshold

    def _add(self, tagged_keys: list, in_runs: np.ndarray, signature,
             shingles: np.ndarray) -> None:
        """Keeps a document: its signature, its shingles, and its place in each of its buckets
        that has fewer than WITHIN_RUN_CANDIDATES_PER_BUCKET (`in_runs` of them in the runs)."""
        document = self.kept
        self.kept += 1
        self.signatures.append(signature)
        os.pwrite(self.shingles.fileno(), shingles.tobytes(), self.shingle_total * 4)
        self.shingle_total += len(shingles)
        self.shingle_ends.append(self.shingle_total)
        self.buckets.add_below(tagged_keys, in_runs.tolist(), document,
                               WITHIN_RUN_CANDIDATES_PER_BUCKET)

    def shingles_of(self, document: int) -> np.ndarray:
        start = int(self.shingle_ends[document - 1]) if document else 0
        end = int(self.shingle_ends[document])
        return np.frombuffer(os.pread(self.shingles.fileno(), (end - start) * 4, start * 4),
                             np.uint32)
