"""The within-run de-duplicator's state (dedup.py), kept on disk so that a prep run's memory does
not grow with its corpus: `Records`, fixed-size records by number (the kept documents'
signatures and shingle ends), and `KeyStore`, a multimap from uint64 keys to document numbers
(exact-duplicate keys, LSH buckets) in a sqlite3 table.

KeyStore is the standard library's sqlite3, not the hand-written sorted runs it replaced
(bench/dedup_store.py, bench/README.md): at 10M pages it costs 7% more CPU and a sixth of their
peak memory (327 MiB against 2,089 MiB), at 1M 1.4x their time. The files are the work folder's
and go with it.
"""

import array
import json
import os
import sqlite3

import numpy as np

RECENT_ENTRIES = 1 << 14  # KeyStore entries held in a dict before `settle` writes them
CACHE_KIB = 64 * 1024  # sqlite's page cache, each KeyStore
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


class KeyStore:
    """A multimap from uint64 keys to uint32 values, each key's values in the order added: the
    newest in a dict (`recent`), the rest in a sqlite3 table of one row a key, its values a blob
    of uint32, written by `settle` in one transaction."""

    def __init__(self, folder: str, name: str):
        self.recent = {}  # key -> [values], not yet in the table
        self.recent_entries = 0
        # pass 1 runs inside tokenizers' BPE trainer, which draws it from a thread of its own
        self.db = sqlite3.connect(os.path.join(folder, f"{name}.sqlite"), isolation_level=None,
                                  check_same_thread=False)
        self.db.executescript(  # a work folder, made again after a crash: no journal, no syncs
            f"PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-{CACHE_KIB};"
            "CREATE TABLE entries (key INTEGER PRIMARY KEY, vals BLOB) WITHOUT ROWID")

    def in_runs(self, keys: np.ndarray) -> tuple:
        """(query, value) arrays: for each of `keys` found in the table (not in `recent`), one
        pair per value, in query order, each query's values in the order added; one query a
        call."""
        keys = np.asarray(keys, np.uint64).view(np.int64)  # sqlite's integers are signed
        rows = self.db.execute(
            "SELECT key, vals FROM entries WHERE key IN (SELECT value FROM json_each(?))"
            " ORDER BY key", (json.dumps(np.unique(keys).tolist()),)).fetchall()
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0, np.uint32)
        found, blobs = zip(*rows)
        found = np.array(found, np.int64)
        held = np.array([len(blob) // 4 for blob in blobs])
        at = np.minimum(np.searchsorted(found, keys), len(found) - 1)
        count = np.where(found[at] == keys, held[at], 0)
        first = (np.cumsum(held) - held)[at]
        values = np.frombuffer(b"".join(blobs), np.uint32)
        return (np.repeat(np.arange(len(keys)), count),
                values[np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())])

    def add(self, key: int, value: int) -> None:
        self.recent.setdefault(key, []).append(value)
        self.recent_entries += 1

    def add_below(self, keys: list, in_runs: list, value: int, most: int) -> None:
        """Adds `value` under each of `keys` (distinct) that has fewer than `most` values,
        `in_runs` of them (a count per key) in the table."""
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
        """Writes the recent entries to the table once there are RECENT_ENTRIES of them (call it
        between lookups: `in_runs` answers from the table as it was)."""
        if self.recent_entries < RECENT_ENTRIES:
            return
        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT INTO entries VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET vals = CAST(vals || excluded.vals AS BLOB)",
            ((key - (key >> 63 << 64), array.array("I", values).tobytes())
             for key, values in self.recent.items()))
        self.db.execute("COMMIT")
        self.recent, self.recent_entries = {}, 0

    def stored(self) -> int:
        """The entries in the table."""
        total = self.db.execute("SELECT coalesce(sum(length(vals)), 0) / 4 FROM entries")
        return total.fetchone()[0]
