"""The within-run de-duplicator's on-disk state (data_prep/spill.py): its sqlite3 key store
answers as a dict of lists would, through many settles, and the de-duplicator decides as it did
with everything in memory."""

import numpy as np

from data_prep import spill
from data_prep.dedup import EXACT, KEPT, NEAR, Deduplicator
from data_prep.near import shingle_hashes, signature


def test_the_key_store_answers_as_a_dict_of_lists_through_settles(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "RECENT_ENTRIES", 50)
    rng = np.random.default_rng(0)
    runs, reference = spill.KeyStore(str(tmp_path), "t"), {}
    for value in range(3000):
        keys = rng.integers(0, 400, 5, dtype=np.uint64)  # few keys: long lists, equal keys
        keys[0] |= np.uint64(1 << 63)  # a key above sqlite's signed integers
        queries, values = runs.in_runs(keys)
        assert (np.diff(queries) >= 0).all()  # in query order (judge slices it so)
        for i, key in enumerate(keys.tolist()):
            stored = values[queries == i].tolist() + runs.recent.get(key, [])
            assert stored == reference.get(key, []), (value, key)
        for key in set(keys.tolist()):
            runs.add(key, value)
            reference.setdefault(key, []).append(value)
        runs.settle()
    assert runs.stored() + runs.recent_entries == sum(map(len, reference.values()))


def test_add_below_fills_a_key_to_its_limit_counting_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "RECENT_ENTRIES", 4)
    runs = spill.KeyStore(str(tmp_path), "t")
    for value in range(20):
        queries, _ = runs.in_runs(np.array([1, 2], np.uint64))
        runs.add_below([1, 2], np.bincount(queries, minlength=2).tolist(), value, 3)
        runs.settle()
    queries, values = runs.in_runs(np.array([1, 2], np.uint64))
    for i, key in enumerate((1, 2)):
        assert values[queries == i].tolist() + runs.recent.get(key, []) == [0, 1, 2]


def test_records_read_back_from_memory_and_from_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "TAIL_RECORDS", 3)
    records = spill.Records(str(tmp_path / "r"), np.uint32, (4,))
    for i in range(10):
        records.append(np.full(4, i))
    assert len(records) == 10 and len(records.mapped) == 9 and len(records.tail) == 1
    assert records[[9, 0, 4]][:, 0].tolist() == [9, 0, 4] and records[9][0] == 9
    assert records.sync()[:, 1].tolist() == list(range(10))


def test_the_deduplicator_decides_alike_with_its_buckets_in_memory_or_in_the_table(tmp_path,
                                                                                   monkeypatch):
    """Web-like pages (most share one block, so buckets overflow), near and exact copies: the
    verdicts with everything in the dict (the reference) and with the table written every few
    documents are the same."""
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(5000)]
    block = " ".join(rng.choice(words, 60))
    pages = []
    for i in range(300):
        own = " ".join(rng.choice(words, 25))
        pages.append(f"{block} {own}" if i % 3 else own)
        if i % 10 == 0:
            pages.append(pages[-1].replace(own.split()[0], "changed", 1))  # a near copy
        if i % 25 == 0:
            pages.append(pages[-1])  # an exact copy
    # near copies of early pages, long after them: their candidates are in the table
    pages += [page.replace(page.split()[-1], "late", 1) for page in pages[::8]]
    shingles = [shingle_hashes(page, 5) for page in pages]
    signatures = np.stack([signature(s, 128) for s in shingles])
    keys = [hash(page) % 2**63 for page in pages]

    def judged(recent: int, folder) -> tuple:
        monkeypatch.setattr(spill, "RECENT_ENTRIES", recent)
        monkeypatch.setattr(spill, "TAIL_RECORDS", 5)
        folder.mkdir()
        dedup = Deduplicator("minhash", 0.8, 128, str(folder))
        verdicts = []
        for start in range(0, len(pages), 16):
            end = min(start + 16, len(pages))
            verdicts += dedup.judge(keys[start:end], signatures[start:end], shingles[start:end])
        return dedup, verdicts

    reference, expected = judged(1 << 30, tmp_path / "memory")
    dedup, verdicts = judged(40, tmp_path / "table")
    assert not reference.buckets.stored() and dedup.buckets.stored() > 40
    assert verdicts == expected
    assert verdicts.count(EXACT) == 12 and verdicts.count(NEAR) >= 35
    assert verdicts[-40:].count(NEAR) >= 38
    assert verdicts.count(KEPT) == dedup.kept == len(dedup.signatures)
    kept_pages = [s for s, v in zip(shingles, verdicts) if v == KEPT]
    for document in (0, 7, dedup.kept - 1):
        assert dedup.shingles_of(document).tolist() == kept_pages[document].tolist()
        assert (dedup.signatures[document] == signature(kept_pages[document], 128)).all()
