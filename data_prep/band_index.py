"""A prepared split's LSH index (SPLIT.band_keys.npy: each band's keys sorted, [bands,
documents] uint64; SPLIT.band_order.npy: the documents in that order): written once by the run
that prepares the split, and searched a band at a time, memory-mapped, for each query's bucket
heads (data_prep/across.py)."""

import numpy as np

from data_prep.near import CANDIDATES_PER_BUCKET, band_keys, lsh_shape

BAND_KEYS, BAND_ORDER = "band_keys.npy", "band_order.npy"


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


class BandTables:
    """Per band, each part's documents in key order, to find each query's bucket heads (its
    CANDIDATES_PER_BUCKET earliest documents): the stored index of every part, memory-mapped, so
    that they cost no memory however large. The parts being merged count as one collection (the
    heads of a bucket are its earliest over all of them, read part by part in order); each fixed
    part gives heads of its own."""

    def __init__(self, parts: list, offsets: np.ndarray, threshold: float, num_perm: int):
        self.shape = lsh_shape(threshold, num_perm)
        self.groups = []  # [(sorted keys [bands, n], documents in that order, first position)]
        merged = []
        for index, part in enumerate(parts):
            if offsets[index] == offsets[index + 1]:
                continue
            table = (*part.band_index(), int(offsets[index]))
            if part.fixed:
                self.groups.append([table])
            else:
                merged.append(table)
        if merged:
            self.groups.append(merged)

    def candidates(self, queries: np.ndarray, before: int, gone: np.ndarray) -> tuple:
        """(query, position) pairs: each query document (a column of `queries`, [bands, n] band
        keys) with the heads of every bucket it falls in: the CANDIDATES_PER_BUCKET earliest
        documents of the bucket before position `before` that are not `gone`, as collection
        positions."""
        query, position = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for group in self.groups:
            for band in range(queries.shape[0]):
                wanted = np.full(queries.shape[1], CANDIDATES_PER_BUCKET)  # heads still to find
                for sorted_keys, documents, first in group:
                    if first >= before:  # a later part: its documents are no candidates
                        break
                    keys = sorted_keys[band]
                    low = np.searchsorted(keys, queries[band], side="left")
                    high = np.searchsorted(keys, queries[band], side="right")
                    asked = np.flatnonzero((high > low) & (wanted > 0))
                    # the queries of one run share a key, so they found the same heads so far
                    runs, once, back = np.unique(low[asked], return_index=True,
                                                 return_inverse=True)
                    run_of, heads = bucket_heads(documents[band], runs, high[asked][once], first,
                                                 before, gone, wanted[asked][once])
                    counts = np.bincount(run_of, minlength=len(runs))  # each query: its run's
                    starts = np.cumsum(counts) - counts
                    per_query = counts[back]
                    at = np.repeat(starts[back] - (np.cumsum(per_query) - per_query),
                                   per_query) + np.arange(per_query.sum())
                    query.append(np.repeat(asked, per_query))
                    position.append(heads[at])
                    wanted[asked] -= per_query
        return np.concatenate(query), np.concatenate(position)


def bucket_heads(documents, low: np.ndarray, high: np.ndarray, first: int, before: int,
                 gone: np.ndarray, wanted: np.ndarray) -> tuple:
    """(run, position) of the heads of each run [low, high) of a band's sorted table: its
    `wanted` (per run) earliest documents (position = documents[i] + first) before `before` and
    not `gone`, sorted by run. Runs are read CANDIDATES_PER_BUCKET entries a round, each run
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
        chosen = usable & (taken[pending, None] + np.cumsum(usable, axis=1)
                           <= wanted[pending, None])
        rows, _ = np.nonzero(chosen)
        run_of.append(pending[rows])
        heads.append(positions[chosen])
        taken[pending] += chosen.sum(axis=1)
        done = (taken[pending] >= wanted[pending]) | ~inside[:, -1] | (positions[:, -1] >= before)
        pending, offset = pending[~done], offset + count
    run_of, heads = np.concatenate(run_of), np.concatenate(heads)
    order = np.argsort(run_of, kind="stable")
    return run_of[order], heads[order]
