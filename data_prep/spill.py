"""The within-run de-duplicator's state (dedup.py), kept on disk so that a prep run's memory does
not grow with its corpus: `Records`, fixed-size records by number (the kept documents'
signatures and shingle ends), and `KeyRuns`, a multimap from uint64 keys to document numbers
(exact-duplicate keys, LSH buckets) in sorted runs.

Hand-written: datasketch's LSH keeps its tables in Python dicts (or Redis/Cassandra servers),
and none of the project's libraries offers an on-disk sorted multimap. The files are the work
folder's and go with it; their pages are the page cache's, not the process's.
"""

import os

import numpy as np

RECENT_ENTRIES = 1 << 14  # KeyRuns entries held in a dict before they are sorted into a run
MERGE_CHUNK = 1 << 20  # entries of each run merged at once
TAIL_RECORDS = 4096  # Records held in memory before they are written and mapped


class Records:
    """Records of one dtype and shape appended to PATH and read back by number: the last ones
    from memory, the rest through a memory map of the file."""

    def __init__(self, path: str, dtype, shape: tuple = ()):
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.file = open(path, "wb")  # closed with this object
        self.mapped = np.zeros((0,) + self.shape, self.dtype)
        self.tail = []

    def __len__(self) -> int:
        return len(self.mapped) + len(self.tail)

    def append(self, record) -> None:
        self.tail.append(np.asarray(record, self.dtype))
        if len(self.tail) == TAIL_RECORDS:
            self.sync()

    def sync(self) -> np.ndarray:
        """Writes the records held in memory and maps the whole file; returns the map."""
        if self.tail:
            self.file.write(np.stack(self.tail).tobytes())
            self.file.flush()
            self.mapped = np.memmap(self.path, self.dtype, mode="r",
                                    shape=(len(self),) + self.shape)
            self.tail = []
        return self.mapped

    def __getitem__(self, numbers) -> np.ndarray:
        """The records of `numbers` (an int or an array of them)."""
        numbers = np.asarray(numbers, np.int64)
        if numbers.ndim == 0:
            number = int(numbers)
            return (self.mapped[number] if number < len(self.mapped)
                    else self.tail[number - len(self.mapped)])
        out = np.empty(numbers.shape + self.shape, self.dtype)
        old = numbers < len(self.mapped)
        out[old] = self.mapped[numbers[old]]
        for at in np.flatnonzero(~old):
            out[at] = self.tail[numbers[at] - len(self.mapped)]
        return out


class KeyRuns:
    """A multimap from uint64 keys to uint32 values, each key's values in the order added. The
    newest entries are in a dict; every RECENT_ENTRIES of them are sorted into a run (two files
    in FOLDER, memory-mapped), and the two newest runs are merged while the older is at most
    twice the newer (as in an LSM tree), so a lookup searches about log2(entries /
    RECENT_ENTRIES) sorted arrays and merging costs O(entries log entries) in all."""

    def __init__(self, folder: str, name: str):
        self.folder, self.name = folder, name
        self.recent = {}  # key -> [values]
        self.recent_entries = 0
        self.runs = []  # (keys, values), the oldest first
        self.files_made = 0

    def in_runs(self, keys: np.ndarray) -> tuple:
        """(query, value) arrays: for each of `keys` found in the runs, one pair per value, in
        query order, each query's values in the order added."""
        keys = np.asarray(keys, np.uint64)
        queries, values = [], []
        for run_keys, run_values in self.runs:
            low = np.searchsorted(run_keys, keys, side="left")
            count = np.searchsorted(run_keys, keys, side="right") - low
            if count.any():
                queries.append(np.repeat(np.arange(len(keys)), count))
                values.append(np.asarray(run_values[np.repeat(low - np.cumsum(count) + count, count)
                                                    + np.arange(count.sum())]))
        if not queries:
            return np.zeros(0, np.int64), np.zeros(0, np.uint32)
        queries, values = np.concatenate(queries), np.concatenate(values)
        order = np.argsort(queries, kind="stable")  # the runs are the oldest first
        return queries[order], values[order]

    def add(self, key: int, value: int) -> None:
        self.recent.setdefault(key, []).append(value)
        self.recent_entries += 1

    def add_below(self, keys: list, in_runs: list, value: int, most: int) -> None:
        """Adds `value` under each of `keys` (distinct) that has fewer than `most` values,
        `in_runs` of them (a count per key) in the runs."""
        recent, added = self.recent, 0
        for key, older in zip(keys, in_runs):
            values = recent.get(key)
            if values is None:
                if older < most:
                    recent[key] = [value]
                    added += 1
            elif older + len(values) < most:
                values.append(value)
                added += 1
        self.recent_entries += added

    def settle(self) -> None:
        """Sorts the recent entries into a run once there are RECENT_ENTRIES of them (call it
        between lookups: `in_runs` answers from the runs as they were)."""
        if self.recent_entries < RECENT_ENTRIES:
            return
        keys = np.fromiter((k for k, values in self.recent.items() for _ in values), np.uint64,
                           self.recent_entries)
        values = np.fromiter((v for vs in self.recent.values() for v in vs), np.uint32,
                             self.recent_entries)
        order = np.argsort(keys, kind="stable")  # a key's values stay in the order added
        self.runs.append(self._write([(keys[order], values[order])], self.recent_entries))
        self.recent, self.recent_entries = {}, 0
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            newer = self.runs.pop()
            older = self.runs.pop()
            self.runs.append(self._write(_merged(older, newer), len(older[0]) + len(newer[0])))
            for run in (older, newer):
                for array in run:
                    os.remove(array.filename)

    def _write(self, pieces, total: int) -> tuple:
        """A run made of `pieces` ((keys, values) sorted, in order), in two new files."""
        self.files_made += 1
        arrays = tuple(np.memmap(os.path.join(self.folder, f"{self.name}.{self.files_made}.{kind}"),
                                 dtype, mode="w+", shape=(total,))
                       for kind, dtype in (("keys", np.uint64), ("values", np.uint32)))
        at = 0
        for keys, values in pieces:
            arrays[0][at:at + len(keys)], arrays[1][at:at + len(keys)] = keys, values
            at += len(keys)
        for array in arrays:
            array.flush()
        return tuple(np.memmap(array.filename, array.dtype, mode="r", shape=(total,))
                     for array in arrays)


def _merged(older: tuple, newer: tuple):
    """The entries of two runs in key order, the older run's first among equal keys, a chunk at
    a time: chunks end at every MERGE_CHUNK-th key of either run (each key whole in one chunk)."""
    bounds = np.unique(np.concatenate([np.asarray(run[0][MERGE_CHUNK::MERGE_CHUNK])
                                       for run in (older, newer)]))
    edges = [np.concatenate([[0], np.searchsorted(run[0], bounds), [len(run[0])]])
             for run in (older, newer)]
    for chunk in range(len(bounds) + 1):
        parts = [(np.asarray(run[0][e[chunk]:e[chunk + 1]]), np.asarray(run[1][e[chunk]:e[chunk + 1]]))
                 for run, e in zip((older, newer), edges)]
        keys = np.concatenate([p[0] for p in parts])
        order = np.argsort(keys, kind="stable")
        yield keys[order], np.concatenate([p[1] for p in parts])[order]
