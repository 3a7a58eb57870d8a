"""De-duplication across prepared folders (the shards of a merge, the corpora of --dedup-against):
exact (the cleaned text's key), then near (data_prep/near.py's LSH candidates checked on the
true shingle Jaccard, at the within-run stage's threshold), keeping each document in the first
place it appears in the order given.

Each prepared folder keeps, per split, for the documents it kept (in their order):
SPLIT.keys.npy (uint64 content keys), SPLIT.minhash.npy ([documents, num_perm] uint32
signatures), SPLIT.shingles.npy and .shingle_offsets.npy (each document's shingle hashes) and
its LSH index (data_prep/band_index.py): SPLIT.band_keys.npy ([bands, documents] uint64, each
band's keys sorted) with SPLIT.band_order.npy (the documents in that order).

A document of a later folder is removed when its true Jaccard with a kept document of an
earlier folder reaches the threshold, that document being among the CANDIDATES_PER_BUCKET
earliest of a bucket it shares (the splits of one folder are not compared with each other: the
run that wrote it did that, in input order). Every part is searched in its stored index,
memory-mapped, a band at a time (the folders being merged read part by part in order, taking a
bucket's earliest documents over all of them), so the indexes cost no memory however large:
what grows with the documents is a few bytes each (their masks, and 28 bytes each at the peak
while exact duplicates are found by sorting their keys). Candidate pairs are at most bands x
CANDIDATES_PER_BUCKET a document, made a chunk of documents at a time. No library does this
over files of signatures: datatrove's and NeMo-Curator's pipelines are for their own formats and
runtimes, datasketch's LSH holds Python objects per key.
"""

import os
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
from tupe_ds.tools.progress_bar import Bar

from data_prep.band_index import BAND_KEYS, BAND_ORDER, BandTables, write_band_index
from data_prep.near import (SHINGLE_OFFSETS, SHINGLES, ShingleFile, band_keys, jaccards,
                            to_verify, write_shingles)

SIGNATURES = "minhash.npy"
NEAR_FILES = (SIGNATURES, SHINGLES, SHINGLE_OFFSETS, BAND_KEYS, BAND_ORDER)
QUERY_CHUNK = 4096  # documents whose candidate pairs are made at once


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


def write_near_files(prefix: str, signatures: list, shingles, shingle_total: int,
                     threshold: float, num_perm: int, chunk: int = 1 << 16) -> None:
    """PREFIX's near-duplicate files: its signatures (the `rows` of each (signatures, rows) of
    `signatures`, in order, copied a chunk at a time), its shingles (`shingles`: each document's
    hashes, `shingle_total` in all, streamed) and its band index."""
    count = sum(len(rows) for _, rows in signatures)
    written = np.lib.format.open_memmap(f"{prefix}.{SIGNATURES}", mode="w+", dtype=np.uint32,
                                        shape=(count, num_perm))
    at = 0
    for theirs, rows in signatures:
        for start in range(0, len(rows), chunk):
            block = rows[start:start + chunk]
            written[at:at + len(block)] = theirs[block]
            at += len(block)
    written.flush()
    write_shingles(prefix, shingles, shingle_total, count)
    write_band_index(prefix, written, threshold, num_perm)


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
    sizes = [len(np.load(f"{part.prefix}.keys.npy", mmap_mode="r")) for part in parts]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    fixed = np.repeat([part.fixed for part in parts], sizes)
    result = exact_duplicates(parts, offsets, fixed)
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


def exact_duplicates(parts: List[Part], offsets: np.ndarray, fixed: np.ndarray) -> List[Removed]:
    """Each part's documents whose key an earlier folder has (none for a fixed part)."""
    first_copy = first_copies(parts, offsets)
    result = []
    for part, before, first, end in zip(parts, folder_starts(parts, offsets), offsets[:-1],
                                        offsets[1:]):
        copy = first_copy[first:end]
        exact = (copy < before) & (not part.fixed)
        result.append(Removed(exact=exact, near=np.zeros(end - first, dtype=bool),
                              exact_by_fixed=int(fixed[copy[exact]].sum())))
    return result


def first_copies(parts: List[Part], offsets: np.ndarray) -> np.ndarray:
    """For each document of the parts, the position of the first document with its key (its
    own, if none came before). Each temporary freed as soon as it is used: about 28 bytes a
    document at the peak."""
    keys = np.empty(offsets[-1], dtype=np.uint64)
    for part, first, end in zip(parts, offsets[:-1], offsets[1:]):
        keys[first:end] = part.keys()
    order = np.argsort(keys, kind="stable")
    in_order = keys[order]
    del keys
    starts = np.empty(len(order), dtype=bool)  # where a key's run begins in key order
    starts[:1] = True
    np.not_equal(in_order[1:], in_order[:-1], out=starts[1:])
    del in_order
    kind = np.int32 if len(order) < 2**31 else np.int64
    head = np.arange(len(order), dtype=kind)  # each entry's run's first entry, in key order
    head[~starts] = 0
    del starts
    np.maximum.accumulate(head, out=head)
    first = np.empty(len(order), dtype=kind)
    first[order] = order[head]
    return first


def find_near(parts: List[Part], offsets: np.ndarray, result: List[Removed], threshold: float,
              fixed: np.ndarray, num_perm: int, quiet: bool) -> None:
    to_query = sum(int((~removed.exact).sum()) for part, removed in zip(parts, result)
                   if not part.fixed)
    progress = Bar(total=to_query, desc="near duplicates", unit=" docs", disable=quiet)
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
