"""The sample index cache: built once per (dataset, seq_len, packing rule) by one process while
the others wait, written atomically, memory-mapped, never read for another dataset or seq_len.

Processes are real (python subprocesses opening the same dataset); a build is slowed down or
killed by wrapping a function in the subprocess only.
"""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tupe_ds.data.index_cache import cached_array, cached_path
from tupe_ds.data.packing import PackedSentences, pack

CLS, SEP = 2, 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(prefix, seed, documents=200):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(documents):
        lengths = rng.integers(1, 20, size=int(rng.integers(1, 6)))
        builder.add_document(rng.integers(10, 900, size=int(lengths.sum())), lengths.tolist())
    builder.finalize(prefix + ".idx")


def expected_boundaries(packed):
    dataset = packed.dataset
    return pack(dataset.sequence_lengths, dataset.document_indices, packed.seq_len - 2)


def index_files(folder):
    """The sample index files in `folder`, whole or not."""
    return sorted(name for name in os.listdir(folder) if ".samples-" in name and ".npy" in name)


def opening_process(prefix, cache, seq_len, before=""):
    """A python process that runs `before` (code), then opens the packed samples and prints
    'built: B' and the number of samples."""
    code = "\n".join([
        "import time, numpy as np",
        "import tupe_ds.data.index_cache as index_cache",
        "import tupe_ds.data.packing as packing",
        "from tupe_ds.tools import log_lines",
        "log_lines.show(rank=0)",  # the lines a command shows
        before,
        f"packed = packing.PackedSentences({prefix!r}, {seq_len}, {CLS}, {SEP}, {cache!r})",
        "print('samples:', len(packed), flush=True)"])
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


SLOW_BUILD = """
real_pack, real_digest = packing.pack, packing.digest_of_version
def slow_pack(*args):
    print("building", flush=True)
    time.sleep(3)
    return real_pack(*args)
def announced_digest(*args):
    print("hashing", flush=True)
    return real_digest(*args)
packing.pack, packing.digest_of_version = slow_pack, announced_digest
"""

KILLED_WHILE_WRITING = """
def half_written(file, array):
    file.write(b"\\x93NUMPY half of an index")
    file.flush()
    print("writing", flush=True)
    time.sleep(600)
index_cache.np.save = half_written
"""


def test_index_is_built_once_then_mapped(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    first = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert np.array_equal(first.boundaries, expected_boundaries(first))
    assert index_files(cache) == [os.path.basename(first.index_path)]
    assert len([name for name in os.listdir(cache) if name.startswith("corpus.document-starts.")
                and name.endswith(".npy")]) == 1
    assert np.array_equal(first.document_starts,
                          np.unique(first.dataset.document_indices[1:-1]))
    assert first.document_starts.flags.aligned and first.boundaries.flags.aligned
    modified = os.stat(first.index_path).st_mtime_ns
    again = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert again.index_path == first.index_path
    assert os.stat(again.index_path).st_mtime_ns == modified  # read, not written
    assert isinstance(again.boundaries, np.memmap) and not again.boundaries.flags.writeable
    assert np.array_equal(again.boundaries, first.boundaries)


def test_other_seq_len_or_dataset_builds_another_index(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    at_32 = PackedSentences(prefix, 32, CLS, SEP, cache)
    at_64 = PackedSentences(prefix, 64, CLS, SEP, cache)
    assert at_64.index_path != at_32.index_path
    assert np.array_equal(at_64.boundaries, expected_boundaries(at_64))
    assert len(at_64) < len(at_32)
    old_boundaries = np.array(at_32.boundaries)
    del at_32, at_64
    write_corpus(prefix, seed=1)  # the same path, other sentences
    changed = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert np.array_equal(changed.boundaries, expected_boundaries(changed))
    assert not np.array_equal(changed.boundaries, old_boundaries)
    assert len(index_files(cache)) == 3


def test_a_changed_rule_builds_another_index(tmp_path, monkeypatch):
    import tupe_ds.data.packing as packing
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    before = PackedSentences(prefix, 32, CLS, SEP, cache).index_path
    monkeypatch.setattr(packing, "PACKING_RULE", "full-sentences/2")
    assert PackedSentences(prefix, 32, CLS, SEP, cache).index_path != before


@pytest.mark.slow
def test_processes_starting_together_build_the_index_once(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    started = time.time()
    processes = [opening_process(prefix, cache, 32, SLOW_BUILD) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert sum(output.count("building") for output in outputs) == 1, outputs
    assert sum(output.count("hashing") for output in outputs) == 1, outputs
    assert sum(output.count("built the sample index") for output in outputs) == 1, outputs
    assert time.time() - started >= 3  # the other one waited for the slow build
    packed = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert all(f"samples: {len(packed)}" in output for output in outputs)
    assert np.array_equal(packed.boundaries, expected_boundaries(packed))
    assert index_files(cache) == [os.path.basename(packed.index_path)]


@pytest.mark.slow
def test_a_killed_build_leaves_no_index_that_is_used(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    process = opening_process(prefix, cache, 32, KILLED_WHILE_WRITING)
    lines = iter(process.stdout.readline, "")
    assert "writing" in (line.strip() for line in lines), "the build never started writing"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    remains = index_files(cache)
    assert len(remains) == 1 and ".npy.tmp-" in remains[0]  # half written, never renamed
    packed = PackedSentences(prefix, 32, CLS, SEP, cache)  # the lock died with the process
    assert np.array_equal(packed.boundaries, expected_boundaries(packed))
    assert index_files(cache) == [os.path.basename(packed.index_path)]


def test_cached_array_keys_name_the_file(tmp_path):
    builds = []

    def build():
        builds.append(1)
        return np.arange(5)

    array, path, built = cached_array(str(tmp_path), "thing", {"a": 1}, build)
    assert built and array.tolist() == [0, 1, 2, 3, 4]
    assert cached_array(str(tmp_path), "thing", {"a": 1}, build)[1:] == (path, False)
    assert cached_array(str(tmp_path), "thing", {"a": 2}, build)[1] != path
    assert len(builds) == 2


def test_sentences_not_back_to_back_are_refused(tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, seed=0)
    from megatron.core.datasets.indexed_dataset import _IndexReader
    real_init = _IndexReader.__init__

    def gap_after_sentence_4(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pointers = self.sequence_pointers.copy()
        pointers[5:] += 4
        self.sequence_pointers = pointers

    monkeypatch.setattr(_IndexReader, "__init__", gap_after_sentence_4)
    with pytest.raises(ValueError, match=r"corpus.idx: sentence 5 does not follow"):
        PackedSentences(prefix, 32, CLS, SEP, str(tmp_path / "cache"))


def test_the_dataset_digest_is_kept_and_a_rewritten_corpus_is_hashed_anew(tmp_path, monkeypatch):
    """The digest goes to the cache folder under the .idx file's version; another process (its
    in-memory cache cleared) reads it without hashing; a corpus written anew at the same place
    gets its own digest, which replaces the old one; another corpus of the same name keeps its."""
    from tupe_ds.data import packing

    prefix = str(tmp_path / "train")
    write_corpus(prefix, seed=0)
    cache = tmp_path / "cache"
    cache.mkdir()

    def kept():
        return {name: (cache / name).read_text() for name in os.listdir(cache)
                if name.startswith("train.digest-") and name.endswith(".txt")}

    digest = packing.dataset_digest(prefix, str(cache))
    dataset = packing.IndexedDataset(prefix)
    assert digest == packing.content_digest(dataset.sequence_lengths, dataset.document_indices)
    assert list(kept().values()) == [digest]
    assert not [name for name in os.listdir(cache) if ".tmp" in name]

    packing.digest_of_version.cache_clear()  # as another rank or a later start
    monkeypatch.setattr(packing, "content_digest", lambda *arrays: pytest.fail("hashed again"))
    assert packing.dataset_digest(prefix, str(cache)) == digest
    monkeypatch.undo()

    elsewhere = str(tmp_path / "other" / "train")
    os.makedirs(os.path.dirname(elsewhere))
    write_corpus(elsewhere, seed=2)
    other = packing.dataset_digest(elsewhere, str(cache))
    time.sleep(0.01)  # another modification time, whatever the file system's resolution
    write_corpus(prefix, seed=1)
    packing.digest_of_version.cache_clear()
    rewritten = packing.dataset_digest(prefix, str(cache))
    dataset = packing.IndexedDataset(prefix)
    assert rewritten not in (digest, other)
    assert rewritten == packing.content_digest(dataset.sequence_lengths, dataset.document_indices)
    assert sorted(kept().values()) == sorted([rewritten, other])


def no_flock(*args):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


NO_FLOCK = """
import errno, fcntl, os
def no_flock(*args):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
fcntl.flock = no_flock  # Lustre mounted without -o flock
"""


def leftovers(cache):
    """Lock files, take-overs and temporary files left in the cache folder (a flock's empty
    NAME.lock is no leftover: it stays)."""
    return [name for name in os.listdir(cache) if name.endswith((".holder", ".break"))
            or ".holder." in name or ".tmp" in name]


def building_code(cache, ready, before=""):
    """Code for a python process whose flock fails, light (numpy and the cache only), that runs `before`
    (code), waits until every process of `ready` is there, then takes the array 'thing' from
    the cache, building it slowly (1 s), and prints its sum."""
    code = "\n".join([
        "import os, sys, time, numpy as np",
        "import tupe_ds.data.index_cache as index_cache",
        NO_FLOCK,
        before,
        "def build():",
        "    print('building', flush=True)",
        "    time.sleep(1)",
        "    return np.arange(1000)",
        f"open(os.path.join({ready!r}, str(os.getpid())), 'w').close()",
        f"while len(os.listdir({ready!r})) < int(sys.argv[1]):",
        "    time.sleep(0.01)",
        f"array, path, built = index_cache.cached_array({cache!r}, 'thing', {{'a': 1}}, build)",
        "print('sum:', int(array.sum()), flush=True)"])
    return code


def test_without_flock_processes_starting_together_build_once(tmp_path):
    """flock fails with ENOSYS in both processes: the lock file made by a hard link takes its
    place; one builds while the other waits, and both map the one copy."""
    cache, ready = str(tmp_path / "cache"), tmp_path / "ready"
    ready.mkdir()
    code = building_code(cache, str(ready))
    processes = [subprocess.Popen([sys.executable, "-c", code, "2"], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert sum(output.count("building") for output in outputs) == 1, outputs
    assert all("sum: 499500" in output for output in outputs), outputs
    assert [name for name in os.listdir(cache) if name.endswith(".npy")] == [
        os.path.basename(cached_path(cache, "thing", {"a": 1}))]
    assert leftovers(cache) == []


def test_without_flock_a_killed_builders_lock_is_taken_over(tmp_path, monkeypatch, capsys):
    """A build killed while writing, flock failing: its lock file names a process of this
    machine that has ended, so the next builder takes it over at once, saying so; the half
    written array was never linked into place and is removed."""
    cache, ready = str(tmp_path / "cache"), tmp_path / "ready"
    ready.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", building_code(cache, str(ready), KILLED_WHILE_WRITING), "1"],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = iter(process.stdout.readline, "")
    assert "writing" in (line.strip() for line in lines), "the build never started writing"
    holder = cached_path(cache, "thing", {"a": 1})[:-len(".npy")] + ".lock.holder"
    with open(holder) as f:
        assert json.load(f)["pid"] == process.pid
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert [name for name in os.listdir(cache) if ".npy.tmp-" in name]  # half written
    monkeypatch.setattr(fcntl, "flock", no_flock)
    array, path, built = cached_array(cache, "thing", {"a": 1}, lambda: np.arange(1000))
    said = capsys.readouterr().err  # a warning
    assert said.startswith(f"tupe_ds: took over {holder} from process {process.pid} on "
                           f"{socket.gethostname()}, started ")
    assert said.endswith(": its process has ended\n") and said.count("\n") == 1
    assert built and int(array.sum()) == 499500
    assert [name for name in os.listdir(cache) if ".npy" in name] == [os.path.basename(path)]
    assert leftovers(cache) == []


def test_without_flock_the_digest_and_the_indexes_are_kept_through_lock_files(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(fcntl, "flock", no_flock)
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, seed=0)
    first = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert np.array_equal(first.boundaries, expected_boundaries(first))
    again = PackedSentences(prefix, 32, CLS, SEP, cache)
    assert again.index_path == first.index_path and leftovers(cache) == []


def test_without_flock_or_hard_links_the_error_names_the_lock_and_the_flag(tmp_path,
                                                                           monkeypatch):
    def no_link(*args):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(OSError, match=rf"{tmp_path}/thing\.\w+\.lock\.holder: this filesystem "
                                      r"can lock files neither with flock nor with hard links "
                                      r"\(Operation not permitted\); point --index-cache at a "):
        cached_array(str(tmp_path), "thing", {"a": 1}, lambda: np.arange(3))
    assert [name.endswith(".lock") for name in os.listdir(tmp_path)] == [True]  # no record


def test_a_builder_removes_only_its_hosts_dead_builders_remains(tmp_path):
    from tupe_ds.data.index_cache import remove_remains, temporary_name

    path = str(tmp_path / "train.samples-64.0123.npy")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    mine_dead, mine_alive = temporary_name(path, int(dead)), temporary_name(path)
    other_host = f"{path}.tmp-othernode-{dead}"
    for name in (mine_dead, mine_alive, other_host):
        open(name, "w").close()
    remove_remains(path)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n)
                                                  for n in (mine_alive, other_host))


@pytest.mark.slow
def test_one_index_per_run_where_file_locks_hold_per_node_only(data, tmp_path):
    """Two ranks under torchrun with the cache's lock made a no-op (as two nodes see a node-local
    lock): rank 0 builds each index once while the other waits, and both map the same file."""
    from test_run_integrity import run

    cache = tmp_path / "cache"
    output = run(data, tmp_path / "run", "--steps", "1", "--index-cache", str(cache),
                 "--eval-interval", "1", fault="node-local-locks")
    built = [line for line in output.splitlines() if "built the sample index of" in line]
    assert len(built) == 2 and {line.split(" of ")[1].split()[0] for line in built} == {
        os.path.join(data, "train"), os.path.join(data, "valid")}, built
    assert len(index_files(str(cache))) == 2 and not [n for n in os.listdir(cache) if ".tmp" in n]
