"""De-duplication across prepared folders (the shards of a merge, the corpora of --dedup-against):
exact (the cleaned text's key), then near (data_prep/near.py's LSH candidates checked on the
true shingle Jaccard, at the within-run stage's threshold), keeping each document in the first
place it appears in the order given.

Each prepared folder keeps, per split, for the documents it kept (in their order):
SPLIT.keys.npy (uint64 content keys), SPLIT.minhash.npy ([documents, num_perm] uint32
signatures), SPLIT.shingles.npy and .shingle_offsets.npy (each document's shingle hashes) and
its LSH index: SPLIT.band_keys.npy ([bands, documents] uint64, each band's keys sorted) with
SPLIT.band_order.npy (the documents in that order).

A document of a later folder is removed when its true Jaccard with a kept document of an
earlier folder reaches the threshold, that document being among the CANDIDATES_PER_BUCKET
earliest of a bucket it shares (the splits of one folder are not compared with each other: the
run that wrote it did that, in input order). The folders being merged get one in-memory table
per band (12 bytes a document and band, the keys recomputed from the signatures); the corpora
de-duplicated against are searched in their stored indexes, memory-mapped, so they cost no
memory however large. Candidate pairs are at most bands x CANDIDATES_PER_BUCKET a document,
made a chunk of documents at a time. No library does this over files of signatures:
datatrove's and NeMo-Curator's pipelines are for their own formats and runtimes, datasketch's
LSH holds Python objects per key.
"""

import os
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
from tqdm import tqdm

from data_prep.near import (CANDIDATES_PER_BUCKET, SHINGLE_OFFSETS, SHINGLES, ShingleFile,
                            band_keys, jaccards, lsh_shape, to_verify)

SIGNATURES, BAND_KEYS, BAND_ORDER = "minhash.npy", "band_keys.npy", "band_order.npy"
NEAR_FILES = (SIGNATURES, SHINGLES, SHINGLE_OFFSETS, BAND_KEYS, BAND_ORDER)
QUERY_CHUNK = 4096  # documents whose candidate pairs are made at once


def write_band_index(prefix: str, signatures: np.ndarray, threshold: float,
                     num_perm: int) -> None:
    """PREFIX.band_keys.npy and .band_order.npy: each LSH band's keys of the documents'
    signatures, sorted, and the documents in that order (stable: the earliest first). A band at
    a time, into the files: 16 bytes a document in memory, not the index's 12 a band."""
    bands, rows = lsh_shape(threshold, num_perm)
    shape = (bands, len(signatures))
    keys = np.lib.format.open_memmap(f"{prefix}.{BAND_KEYS}", mode="w+", dtype=np.uint64,
                                     shape=shape)
    order = np.lib.format.open_memmap(f"{prefix}.{BAND_ORDER}", mode="w+", shape=shape,
                                      dtype=np.uint32 if len(signatures) < 2**32 else np.int64)
    for band in range(bands):
        band_key = band_keys(signatures[:, band * rows:(band + 1) * rows], 1, rows)[0]
        order[band] = band_order = np.argsort(band_key, kind="stable")
        keys[band] = band_key[band_order]
    keys.flush()
    order.flush()


@dataclass
class Part:
    """One split of one prepared folder, in the collection's order. `fixed`: a corpus
    de-duplicated against, whose documents all stay (and count as kept). `same_folder`: another
    split of the previous part's folder, so not compared with it: the run that wrote the folder
    de-duplicated all its splits together, in input order."""

    prefix: str
    fixed: bool = False
    same_folder: bool = False

    def keys(self) -> np.ndarray:
        return np.load(f"{self.prefix}.keys.npy")

    def signatures(self) -> np.ndarray:
        return np.load(f"{self.prefix}.{SIGNATURES}", mmap_mode="r")

    def band_index(self) -> tuple:
        return (np.load(f"{self.prefix}.{BAND_KEYS}", mmap_mode="r"),
                np.load(f"{self.prefix}.{BAND_ORDER}", mmap_mode="r"))


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
    """Every part has signatures of num_perm values, shingles and an index of `bands` bands,
    readable and of its documents' count (a damaged file is named)."""
    for part in parts:
        for name in NEAR_FILES:
            if not os.path.exists(f"{part.prefix}.{name}"):
                raise ValueError(f"{part.prefix}.{name}: missing; near duplicates across folders "
                                 "need every folder prepared by tupe-prep with --dedup minhash "
                                 "(prepared before this version: prepare it again)")
        try:
            count = len(part.keys())
            signatures, (band_keys_, band_order), shingles = (
                part.signatures(), part.band_index(), ShingleFile(part.prefix))
        except (ValueError, OSError, EOFError) as error:
            raise ValueError(f"{part.prefix}: a near-duplicate file cannot be read ({error}); "
                             "prepare the folder again") from None
        shapes = (signatures.shape, band_keys_.shape, band_order.shape, len(shingles))
        expected = ((count, num_perm), (bands, count), (bands, count), count)
        if shapes != expected:
            raise ValueError(f"{part.prefix}: signatures, band index and shingles of shapes "
                             f"{shapes} for {count} documents; expected {expected}: prepared "
                             "with another --num-perm or --jaccard-threshold, or before this "
                             "version (prepare it again)?")
        if count and (shingles.offsets[0] != 0 or shingles.offsets[-1] != len(shingles.hashes)):
            raise ValueError(f"{part.prefix}.{SHINGLE_OFFSETS}: does not span "
                             f"{part.prefix}.{SHINGLES} ({len(shingles.hashes)} hashes); "
                             "damaged: prepare the folder again")


def duplicates(parts: List[Part], threshold: float = 0.0, num_perm: int = 128,
               near: bool = True, quiet: bool = False) -> List[Removed]:
    """What to remove from each part: exact duplicates of any earlier folder's document, then
    (`near`) documents whose signature agrees on at least `threshold` of its values with a kept
    document of an earlier folder that shares an LSH band with it. Fixed parts lose nothing.
    `quiet`: no progress bar (else one on stderr for the near duplicates, most of the time)."""
    keys = [part.keys() for part in parts]
    sizes = [len(part_keys) for part_keys in keys]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    fixed = np.repeat([part.fixed for part in parts], sizes)
    first_copy = first_copies(np.concatenate(keys))
    result = []
    starts = folder_starts(parts, offsets)
    for part, before, first, size in zip(parts, starts, offsets[:-1], sizes):
        copy = first_copy[first:first + size]
        exact = (copy < before) & (not part.fixed)
        result.append(Removed(exact=exact, near=np.zeros(size, dtype=bool),
                              exact_by_fixed=int(fixed[copy[exact]].sum())))
    if near:
        find_near(parts, offsets, result, threshold, fixed, num_perm, quiet)
    return result


def folder_starts(parts: List[Part], offsets: np.ndarray) -> List[int]:
    """Each part's first position in the collection, or its folder's when it is `same_folder`:
    a part is compared with the documents before that."""
    starts = []
    for part, first in zip(parts, offsets[:-1]):
        starts.append(starts[-1] if part.same_folder else int(first))
    return starts


def first_copies(keys: np.ndarray) -> np.ndarray:
    """For each document, the position of the first document with its key (its own, if none
    came before)."""
    order = np.argsort(keys, kind="stable")
    return order[np.searchsorted(keys[order], keys, side="left")]


class BandTables:
    """Per band, the collection's documents in key order, to find each query's bucket heads (its
    CANDIDATES_PER_BUCKET earliest documents): one table over the parts being merged, held in
    memory, and the stored index of each fixed part, memory-mapped."""

    def __init__(self, parts: List[Part], offsets: np.ndarray, threshold: float, num_perm: int):
        self.shape = lsh_shape(threshold, num_perm)
        self.tables = []  # (sorted keys [bands, n], documents of each band, first position)
        merged = [index for index, part in enumerate(parts) if not part.fixed]
        for index, part in enumerate(parts):
            if part.fixed:
                self.tables.append((*part.band_index(), offsets[index]))
        if merged:
            keys = np.concatenate([band_keys(parts[index].signatures(), *self.shape)
                                   for index in merged], axis=1)
            positions = np.concatenate([np.arange(offsets[index], offsets[index + 1])
                                        for index in merged])
            kind = np.int32 if offsets[-1] < 2**31 else np.int64
            documents = []
            for band in range(len(keys)):  # one band's temporaries at a time, keys sorted in place
                order = np.argsort(keys[band], kind="stable")
                keys[band] = keys[band][order]
                documents.append(positions[order].astype(kind))
            self.tables.append((keys, documents, 0))

    def candidates(self, queries: np.ndarray, before: int, gone: np.ndarray) -> tuple:
        """(query, position) pairs: each query document (a column of `queries`, [bands, n] band
        keys) with the heads of every bucket it falls in: the CANDIDATES_PER_BUCKET earliest
        documents of the bucket before position `before` that are not `gone`, as collection
        positions."""
        query, position = [], []
        for sorted_keys, documents, first in self.tables:
            for band in range(queries.shape[0]):
                keys = sorted_keys[band]
                low = np.searchsorted(keys, queries[band], side="left")
                high = np.searchsorted(keys, queries[band], side="right")
                asked = np.flatnonzero(high > low)  # the queries whose bucket is there
                runs, once, back = np.unique(low[asked], return_index=True, return_inverse=True)
                run_of, heads = bucket_heads(documents[band], runs, high[asked][once], first,
                                             before, gone)
                counts = np.bincount(run_of, minlength=len(runs))  # each query: its run's heads
                starts = np.cumsum(counts) - counts
                per_query = counts[back]
                at = np.repeat(starts[back] - (np.cumsum(per_query) - per_query), per_query) + \
                    np.arange(per_query.sum())
                query.append(np.repeat(asked, per_query))
                position.append(heads[at])
        return np.concatenate(query), np.concatenate(position)


def bucket_heads(documents, low: np.ndarray, high: np.ndarray, first: int, before: int,
                 gone: np.ndarray) -> tuple:
    """(run, position) of the heads of each run [low, high) of a band's sorted table: its
    CANDIDATES_PER_BUCKET earliest documents (position = documents[i] + first) before `before`
    and not `gone`, sorted by run. Runs are read CANDIDATES_PER_BUCKET entries a round, each run
    until it has its heads, ends, or reaches `before` (a run is in position order)."""
    count = CANDIDATES_PER_BUCKET
    taken = np.zeros(len(low), dtype=np.int64)
    pending, offset = np.arange(len(low)), 0
    run_of, heads = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    while len(pending):
        at = low[pending, None] + offset + np.arange(count)
        inside = at < high[pending, None]
        positions = np.where(inside, np.asarray(documents[np.where(inside, at, low[pending, None])])
                             .astype(np.int64) + first, before)
        usable = (positions < before) & ~gone[np.minimum(positions, len(gone) - 1)]
        chosen = usable & (taken[pending, None] + np.cumsum(usable, axis=1) <= count)
        rows, _ = np.nonzero(chosen)
        run_of.append(pending[rows])
        heads.append(positions[chosen])
        taken[pending] += chosen.sum(axis=1)
        done = (taken[pending] >= count) | ~inside[:, -1] | (positions[:, -1] >= before)
        pending, offset = pending[~done], offset + count
    run_of, heads = np.concatenate(run_of), np.concatenate(heads)
    order = np.argsort(run_of, kind="stable")
    return run_of[order], heads[order]


def find_near(parts: List[Part], offsets: np.ndarray, result: List[Removed], threshold: float,
              fixed: np.ndarray, num_perm: int, quiet: bool) -> None:
    to_query = sum(int((~removed.exact).sum()) for part, removed in zip(parts, result)
                   if not part.fixed)
    # opened before the band tables are built: their time (a few percent) shows as its start
    progress = tqdm(total=to_query, desc="near duplicates", unit=" docs", disable=quiet)
    tables = BandTables(parts, offsets, threshold, num_perm)
    gone = np.concatenate([removed.exact for removed in result])  # grows part by part
    signatures = [part.signatures() for part in parts]
    shingles = [ShingleFile(part.prefix) for part in parts]
    starts = folder_starts(parts, offsets)
    for index, (part, removed) in enumerate(zip(parts, result)):
        if part.fixed:
            continue
        first = offsets[index]
        by_fixed = np.zeros(len(removed.near), dtype=bool)
        queried = np.flatnonzero(~removed.exact)
        for start in range(0, len(queried), QUERY_CHUNK):
            documents = queried[start:start + QUERY_CHUNK]
            queries = band_keys(np.asarray(signatures[index][documents]), *tables.shape)
            query, candidate = tables.candidates(queries, starts[index], gone)
            pairs = np.unique(np.stack([documents[query], candidate]), axis=1)
            document, candidate = pairs[0], pairs[1]
            checked = to_verify(document, agreement(signatures, offsets, index, document,
                                                    candidate), threshold)
            document, candidate = document[checked], candidate[checked]
            similar = similarity(shingles, offsets, index, document, candidate) >= threshold
            removed.near[document[similar]] = True
            by_fixed[document[similar & fixed[candidate]]] = True
            progress.update(len(documents))
        removed.near_by_fixed = int(by_fixed.sum())
        gone[first:first + len(removed.near)] |= removed.near
    progress.close()


def similarity(shingles: list, offsets: np.ndarray, index: int, document: np.ndarray,
               candidate: np.ndarray) -> np.ndarray:
    """The true Jaccard of each pair (document of part `index`, candidate anywhere before it),
    over their shingles, read from the memory-mapped files part by part."""
    result = np.empty(len(document), dtype=np.float64)
    owner = np.searchsorted(offsets, candidate, side="right") - 1
    for part in np.unique(owner):
        here = owner == part
        result[here] = jaccards(shingles[index].gather(document[here]),
                                shingles[part].gather(candidate[here] - offsets[part]))
    return result


def agreement(signatures: list, offsets: np.ndarray, index: int, document: np.ndarray,
              candidate: np.ndarray, block: int = 1 << 15) -> np.ndarray:
    """The share of equal signature values of each pair (document of part `index`, candidate
    anywhere before it), read from the memory-mapped signatures part by part, `block` pairs at a
    time (two signatures a pair: 16 MB at 128 values)."""
    result = np.empty(len(document), dtype=np.float64)
    owner = np.searchsorted(offsets, candidate, side="right") - 1
    for start in range(0, len(document), block):
        pairs = slice(start, start + block)
        own = np.asarray(signatures[index][document[pairs]])
        theirs = np.empty_like(own)
        for part in np.unique(owner[pairs]):
            here = owner[pairs] == part
            theirs[here] = signatures[part][candidate[pairs][here] - offsets[part]]
        result[pairs] = (own == theirs).mean(axis=1)
    return result
