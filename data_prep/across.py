"""De-duplication across prepared folders (the shards of a merge, the corpora of --dedup-against):
exact (the cleaned text's key), then near (MinHash, with the LSH bands and Jaccard threshold of
the within-run stage), keeping each document in the first place it appears in the order given.

Each prepared folder keeps, per split, for the documents it kept (in their order):
SPLIT.keys.npy (uint64 content keys), SPLIT.minhash.npy ([documents, num_perm] uint32
signatures) and SPLIT.bands.npy ([bands, documents] uint64: a hash of each LSH band's values).

Near duplicates are found as the within-run Deduplicator finds them (datasketch's MinHashLSH,
then the signatures' agreement checked against the threshold), over the whole collection: a
document of a later part is removed when it shares a band with a kept document of an earlier
part whose signature agrees on `threshold` of its values. Instead of an LSH of inserted keys,
each band is one sorted table over every document of the collection (12 bytes a document: key
and number), so memory is 12 x bands bytes a document (144 with the default 12 bands: 1.6 GB
of allocations and 67 s at 10M documents, bench/README.md) and signatures are read,
memory-mapped, only for candidate pairs. No library does this over files of signatures: datatrove's and NeMo-Curator's pipelines
are for their own formats and runtimes, datasketch's LSH holds Python objects per key.
"""

import os
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
from datasketch import MinHashLSH

from tupe_ds.data.counter_random import absorb

LSH_WEIGHTS = (0.2, 0.8)  # false positives vs false negatives: few near-duplicates missed
SIGNATURES, BANDS = "minhash.npy", "bands.npy"


def lsh_shape(threshold: float, num_perm: int) -> tuple:
    """(bands, rows per band) of the within-run LSH (datasketch's choice for these weights)."""
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    return lsh.b, lsh.r


def band_keys(signatures: np.ndarray, bands: int, rows: int, chunk: int = 1 << 16) -> np.ndarray:
    """[bands, documents] uint64: band j's key hashes signature values [j*rows, (j+1)*rows)."""
    keys = np.empty((bands, len(signatures)), dtype=np.uint64)
    for start in range(0, len(signatures), chunk):
        block = np.asarray(signatures[start:start + chunk], dtype=np.uint64)
        for band in range(bands):
            key = np.zeros(len(block), dtype=np.uint64)
            for column in range(band * rows, (band + 1) * rows):
                key = absorb(key, block[:, column])
            keys[band, start:start + len(block)] = key
    return keys


@dataclass
class Part:
    """One split of one prepared folder, in the collection's order. `fixed`: a corpus
    de-duplicated against, whose documents all stay (and count as kept)."""

    prefix: str
    fixed: bool = False

    def keys(self) -> np.ndarray:
        return np.load(f"{self.prefix}.keys.npy")

    def signatures(self) -> np.ndarray:
        return np.load(f"{self.prefix}.{SIGNATURES}", mmap_mode="r")

    def bands(self) -> np.ndarray:
        return np.load(f"{self.prefix}.{BANDS}", mmap_mode="r")


@dataclass
class Removed:
    """A part's documents removed as exact or near duplicates of an earlier part's; `by_fixed`:
    those whose earlier copy is in a fixed part (another corpus)."""

    exact: np.ndarray
    near: np.ndarray
    exact_by_fixed: int = 0
    near_by_fixed: int = 0

    @property
    def any(self) -> np.ndarray:
        return self.exact | self.near


def check_near_files(parts: Sequence[Part], num_perm: int, bands: int) -> None:
    """Every part has signatures of num_perm values and `bands` band keys per document."""
    for part in parts:
        for name in (SIGNATURES, BANDS):
            if not os.path.exists(f"{part.prefix}.{name}"):
                raise ValueError(f"{part.prefix}.{name}: missing; near duplicates across folders "
                                 "need every folder prepared by tupe-prep with --dedup minhash "
                                 "(prepared before this version: prepare it again)")
        shape, count = part.signatures().shape, len(part.keys())
        if shape != (count, num_perm) or part.bands().shape != (bands, count):
            raise ValueError(f"{part.prefix}: signatures {shape} and band keys "
                             f"{part.bands().shape} for {count} documents; expected "
                             f"({count}, {num_perm}) and ({bands}, {count}): prepared with "
                             "another --num-perm or --jaccard-threshold?")


def duplicates(parts: List[Part], threshold: float = 0.0, near: bool = True) -> List[Removed]:
    """What to remove from each part: exact duplicates of any earlier part's document, then
    (`near`) documents whose signature agrees on at least `threshold` of its values with a kept
    document of an earlier part that shares an LSH band with it. Fixed parts lose nothing."""
    keys = [part.keys() for part in parts]
    sizes = [len(part_keys) for part_keys in keys]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    fixed = np.repeat([part.fixed for part in parts], sizes)
    first_copy = first_copies(np.concatenate(keys))
    result = []
    for part, first, size in zip(parts, offsets[:-1], sizes):
        copy = first_copy[first:first + size]
        exact = (copy < first) & (not part.fixed)
        result.append(Removed(exact=exact, near=np.zeros(size, dtype=bool),
                              exact_by_fixed=int(fixed[copy[exact]].sum())))
    if near:
        find_near(parts, offsets, result, threshold, fixed)
    return result


def first_copies(keys: np.ndarray) -> np.ndarray:
    """For each document, the position of the first document with its key (its own, if none
    came before)."""
    order = np.argsort(keys, kind="stable")
    return order[np.searchsorted(keys[order], keys, side="left")]


def band_tables(parts: List[Part]) -> list:
    """Per band: (every document's key sorted, the documents in that order)."""
    tables = []
    for band in range(parts[0].bands().shape[0]):
        keys = np.concatenate([np.asarray(part.bands()[band]) for part in parts])
        order = np.argsort(keys, kind="stable")
        tables.append((keys[order], order.astype(np.int32 if len(keys) < 2**31 else np.int64)))
    return tables


def sharing_a_band(tables: list, bands: np.ndarray, documents: np.ndarray, before: int,
                   gone: np.ndarray) -> tuple:
    """(document, candidate) pairs: `documents` (rows of `bands`, a part's band keys) with each
    document of the collection before position `before`, not `gone`, sharing a band with it."""
    pairs = []
    for band, (sorted_keys, order) in enumerate(tables):
        queries = np.asarray(bands[band])[documents]
        by_key = np.argsort(queries)  # sorted queries search in cache-friendly order
        low, counts = np.empty_like(by_key), np.empty_like(by_key)
        low[by_key] = np.searchsorted(sorted_keys, queries[by_key], side="left")
        counts[by_key] = np.searchsorted(sorted_keys, queries[by_key], side="right") - low[by_key]
        document = np.repeat(documents, counts)
        at = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        candidate = order[np.repeat(low, counts) + at].astype(np.int64)
        earlier = (candidate < before) & ~gone[candidate]
        pairs.append(np.stack([document[earlier], candidate[earlier]]))
    pairs = np.unique(np.concatenate(pairs, axis=1), axis=1)
    return pairs[0], pairs[1]


def find_near(parts: List[Part], offsets: np.ndarray, result: List[Removed], threshold: float,
              fixed: np.ndarray) -> None:
    tables = band_tables(parts)
    gone = np.concatenate([removed.exact for removed in result])  # grows part by part
    signatures = [part.signatures() for part in parts]
    for index, (part, removed) in enumerate(zip(parts, result)):
        if part.fixed:
            continue
        first = offsets[index]
        document, candidate = sharing_a_band(tables, part.bands(),
                                             np.flatnonzero(~removed.exact), first, gone)
        similar = agreement(signatures, offsets, index, document, candidate) >= threshold
        removed.near[document[similar]] = True
        by_fixed = np.zeros(len(removed.near), dtype=bool)
        by_fixed[document[similar & fixed[candidate]]] = True
        removed.near_by_fixed = int(by_fixed.sum())
        gone[first:first + len(removed.near)] |= removed.near


def agreement(signatures: list, offsets: np.ndarray, index: int, document: np.ndarray,
              candidate: np.ndarray) -> np.ndarray:
    """The share of equal signature values of each pair (document of part `index`, candidate
    anywhere before it), read from the memory-mapped signatures part by part."""
    result = np.empty(len(document), dtype=np.float64)
    if len(document) == 0:
        return result
    rows, back = np.unique(document, return_inverse=True)
    own = np.asarray(signatures[index][rows])[back]
    owner = np.searchsorted(offsets, candidate, side="right") - 1
    for part in np.unique(owner):
        here = owner == part
        rows, back = np.unique(candidate[here] - offsets[part], return_inverse=True)
        result[here] = (own[here] == np.asarray(signatures[part][rows])[back]).mean(axis=1)
    return result
