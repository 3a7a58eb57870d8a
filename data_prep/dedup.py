"""Stage 2, de-duplication of documents: exact (hash of the cleaned text), then near duplicates
(data_prep/near.py: LSH candidates, checked on the true Jaccard of their shingles)."""

import hashlib
import os

import numpy as np

from data_prep.near import (CANDIDATES_PER_BUCKET, band_keys, jaccards, lsh_shape,
                            to_verify)


def exact_key(text: str) -> int:
    """64-bit hash of the cleaned text (whitespace and case as cleaned)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class Deduplicator:
    """Keeps the first of each group of duplicates, in input order.

    mode: "exact", "minhash" (exact first, then near duplicates: a document goes when its true
    shingle Jaccard with a kept one reaches `threshold`), "none". The kept documents' shingle
    hashes go to `shingle_spool` (a file, read back only to check candidates), their
    signatures stay in memory (num_perm x 4 bytes each) and each LSH bucket holds at most
    CANDIDATES_PER_BUCKET of them.
    """

    def __init__(self, mode: str = "minhash", threshold: float = 0.8, num_perm: int = 128,
                 shingle_spool: str = None):
        self.mode = mode
        self.threshold = threshold
        self.seen = set()
        self.exact_removed = 0
        self.near_removed = 0
        if mode == "minhash":
            self.bands, self.rows = lsh_shape(threshold, num_perm)
            self.buckets = [{} for _ in range(self.bands)]  # band key -> kept documents
            self.signatures = np.empty((1024, num_perm), dtype=np.uint32)
            self.offsets = [0]  # kept document i's hashes: spool items [offsets[i], offsets[i+1])
            self.spool = open(shingle_spool, "w+b", buffering=0)  # closed with this object

    @property
    def kept(self) -> int:
        return len(self.offsets) - 1

    def keep(self, key: int, signature=None, shingles=None, bands=None) -> bool:
        """Whether to keep this document; `bands`: its band keys (band_keys of its signature,
        computed here when not given)."""
        if self.mode == "none":
            return True
        if key in self.seen:
            self.exact_removed += 1
            return False
        self.seen.add(key)
        if self.mode != "minhash":
            return True
        signature = np.asarray(signature, dtype=np.uint32)
        if bands is None:
            bands = band_keys(signature[None], self.bands, self.rows)[:, 0]
        keys = [int(k) for k in bands]
        candidates = np.array(sorted({document for band, k in enumerate(keys)
                                      for document in self.buckets[band].get(k, ())}), np.int64)
        if len(candidates):
            agreement = (self.signatures[candidates] == signature).mean(axis=1)
            checked = candidates[to_verify(np.zeros(len(candidates), np.int64), agreement,
                                           self.threshold)]
            theirs = [self.shingles_of(int(document)) for document in checked]
            own = np.tile(np.asarray(shingles, dtype=np.uint32), len(checked))
            if len(checked) and jaccards((own, np.full(len(checked), len(shingles))),
                                         (np.concatenate(theirs), [len(t) for t in theirs])
                                         ).max() >= self.threshold:
                self.near_removed += 1
                return False
        self.add(keys, signature, np.asarray(shingles, dtype=np.uint32))
        return True

    def add(self, keys, signature: np.ndarray, shingles: np.ndarray) -> None:
        document = self.kept
        if document == len(self.signatures):
            self.signatures = np.concatenate([self.signatures, np.empty_like(self.signatures)])
        self.signatures[document] = signature
        os.pwrite(self.spool.fileno(), shingles.tobytes(), self.offsets[-1] * 4)
        self.offsets.append(self.offsets[-1] + len(shingles))
        for band, k in enumerate(keys):
            members = self.buckets[band].setdefault(k, [])
            if len(members) < CANDIDATES_PER_BUCKET:
                members.append(document)

    def shingles_of(self, document: int) -> np.ndarray:
        start, end = self.offsets[document], self.offsets[document + 1]
        return np.frombuffer(os.pread(self.spool.fileno(), (end - start) * 4, start * 4),
                             np.uint32)
