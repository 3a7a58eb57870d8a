"""Stage 2, de-duplication of documents: exact (hash of the cleaned text), then MinHash LSH."""

import functools
import hashlib
import re

import numpy as np
from datasketch import MinHash, MinHashLSH

from data_prep.across import LSH_WEIGHTS

WORD = re.compile(r"\w+")
SCHEME = "affine32"  # named, so that signatures made in workers can be rebuilt here


def exact_key(text: str) -> int:
    """64-bit hash of the cleaned text (whitespace and case as cleaned)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int):
    return MinHash(num_perm=num_perm, scheme=SCHEME).permutations  # costly to draw each time


def minhash(num_perm: int, hashvalues=None) -> MinHash:
    return MinHash(num_perm=num_perm, hashvalues=hashvalues, permutations=_permutations(num_perm),
                   scheme=SCHEME)


def minhash_signature(text: str, num_perm: int, shingle: int) -> np.ndarray:
    """MinHash of the text's word `shingle`-grams (lower-cased)."""
    words = WORD.findall(text.lower())
    grams = {" ".join(words[i:i + shingle]) for i in range(max(1, len(words) - shingle + 1))}
    signature = minhash(num_perm)
    signature.update_batch([g.encode("utf-8") for g in grams])
    return signature.hashvalues


class Deduplicator:
    """Keeps the first of each group of duplicates, in input order.

    mode: "exact", "minhash" (exact first, then near-duplicates at Jaccard >= threshold), "none".
    The LSH bands are tuned to miss few near-duplicates; each candidate they return is then
    checked against the threshold on the signatures, so that few unique documents go either.
    """

    def __init__(self, mode: str = "minhash", threshold: float = 0.8, num_perm: int = 128):
        self.mode = mode
        self.num_perm = num_perm
        self.threshold = threshold
        self.seen = set()
        self.signatures = {}  # LSH key -> signature (uint32: affine32 values fit)
        self.lsh = (MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
                    if mode == "minhash" else None)
        self.exact_removed = 0
        self.near_removed = 0

    def keep(self, key: int, signature) -> bool:
        if self.mode == "none":
            return True
        if key in self.seen:
            self.exact_removed += 1
            return False
        self.seen.add(key)
        if self.lsh is not None:
            signature = np.asarray(signature, dtype=np.uint32)
            sketch = minhash(self.num_perm, signature)
            for candidate in self.lsh.query(sketch):
                if np.mean(self.signatures[candidate] == signature) >= self.threshold:
                    self.near_removed += 1
                    return False
            self.signatures[key] = signature
            self.lsh.insert(key, sketch)
        return True
