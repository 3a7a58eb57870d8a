"""Packed FULL-SENTENCES samples over the sentences of a megatron-core IndexedDataset.

Sample k is "[CLS] s_a s_a+1 ... s_b [SEP]": consecutive sentences, as many as fit in seq_len,
crossing document boundaries with a [SEP] between documents (RoBERTa's FULL-SENTENCES, as the
paper trains). A sentence longer than a whole sample is cut to fit. The packing is one greedy
pass over the sentence lengths, written here and compiled with numba (megatron-core's helpers
pack GPT token streams or BERT sentence pairs within documents, neither of which this is). Its
result, the sample index, is built once per (dataset, seq_len, rule) into a cache folder and
memory-mapped by every process (tupe_ds.data.index_cache).
"""

import contextlib
import functools
import glob
import hashlib
import mmap
import logging
import os
import re
import time

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tupe_ds.data.index_cache import LOCK_FIX, cached_array, content_digest
from tupe_ds.tools.files import locked, write_atomically
from tupe_ds.tools.log_lines import EVERY_RANK

logger = logging.getLogger(__name__)

PACKING_RULE = "full-sentences/1"  # change it whenever pack() would return something else


def greedy_boundaries(lengths, document_starts, budget, boundaries):
    """Fills boundaries[:count + 1] and returns count, the number of samples; with an empty
    `boundaries` it only counts."""
    write = len(boundaries) > 0
    count, first, used, document = 0, 0, 0, 1
    last_document = len(document_starts) - 1  # document_starts[-1] is the end of the data
    for sentence in range(len(lengths)):
        while document < last_document and document_starts[document] < sentence:
            document += 1
        crosses = document < last_document and document_starts[document] == sentence
        cost = lengths[sentence] + (1 if crosses and sentence > first else 0)
        if sentence > first and used + cost > budget:
            if write:
                boundaries[count] = first
            count += 1
            first, used, cost = sentence, 0, lengths[sentence]
        used += cost
    if len(lengths) > first:
        if write:
            boundaries[count] = first
        count += 1
    if write:
        boundaries[count] = len(lengths)
    return count


def pack(sentence_lengths: np.ndarray, document_starts: np.ndarray, budget: int) -> np.ndarray:
    """Sample boundaries [samples + 1]: sample k holds sentences [b[k], b[k+1]), whose tokens,
    plus one separator per document boundary crossed, fit in `budget` tokens (a sentence longer
    than `budget` alone in its sample)."""
    lengths = np.asarray(sentence_lengths)  # int32 as megatron-core stores them: no copy
    starts = np.asarray(document_starts, dtype=np.int64)
    compiled = compiled_greedy_boundaries()
    count = compiled(lengths, starts, budget, np.zeros(0, dtype=np.int64))
    boundaries = np.empty(count + 1, dtype=np.int64)
    compiled(lengths, starts, budget, boundaries)
    return boundaries


@functools.lru_cache(maxsize=None)
def compiled_greedy_boundaries():
    """greedy_boundaries compiled by numba (imported here: only the process that builds an index
    pays for it), cached on disk beside this file."""
    from numba import njit
    return njit(cache=True)(greedy_boundaries)


def check_contiguous(dataset: IndexedDataset, prefix: str) -> None:
    """Batches read a sample's sentences as one slice of the .bin: they must lie back to back,
    as megatron-core's builder writes them."""
    lengths, pointers = dataset.sequence_lengths, dataset.index.sequence_pointers
    if len(lengths) and pointers[0] != 0:
        raise ValueError(f"{prefix}.idx: the first sentence does not start the .bin")
    itemsize = dataset.index.dtype_size
    for start in range(0, len(lengths), 1 << 24):  # bounded temporaries
        block = slice(start, min(start + (1 << 24) + 1, len(lengths)))
        gaps = np.flatnonzero(np.diff(pointers[block]) != lengths[block][:-1] * itemsize)
        if len(gaps):
            raise ValueError(f"{prefix}.idx: sentence {start + gaps[0] + 1} does not follow "
                             "the one before it in the .bin; rewrite the dataset with tupe-prep")


def dataset_digest(prefix: str, cache_folder: str) -> str:
    """The content digest of a dataset's sentence lengths and document boundaries: what the
    packed samples are made from (the sample index's key; a checkpoint's data identity).

    Hashing them reads the whole .idx (680 MB at BERT's corpus size), so the digest is kept in
    `cache_folder` beside the sample indexes, named by PREFIX's path and the version of its .idx
    (inode, size, modification time): the other ranks of a run and later starts read it there,
    and a rewritten .idx (a new version) is hashed anew, its old versions' digests removed. A
    process that finds it there reads it without any lock. The first processes to need it hash
    under the cache's lock (`flock`, or a lock file where the filesystem has none:
    tupe_ds/tools/lock.py), one at a time, so that the others read what the first wrote.
    Computed once per process and version."""
    status = os.stat(prefix + ".idx")
    version = (status.st_ino, status.st_size, status.st_mtime_ns)
    place = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:8]
    name = os.path.join(cache_folder, f"{os.path.basename(prefix)}.digest-{place}")
    path = f"{name}-{'-'.join(map(str, version))}.txt"
    digest = kept_digest(path)
    if digest is None:
        os.makedirs(cache_folder, exist_ok=True)
        with locked(name + ".lock", LOCK_FIX):
            digest = kept_digest(path)
            if digest is None:
                digest = digest_of_version(prefix, *version)
                write_atomically(path, digest)
                for old in set(glob.glob(glob.escape(name) + "-*.txt")) - {path}:
                    with contextlib.suppress(FileNotFoundError):  # another node's removal
                        os.remove(old)
    return digest


def kept_digest(path: str):
    """The digest in `path`, or None when there is none (or not a whole one)."""
    try:
        with open(path) as f:
            digest = f.read().strip()
    except FileNotFoundError:
        return None
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


@functools.lru_cache(maxsize=None)
def digest_of_version(prefix: str, *version) -> str:
    dataset = IndexedDataset(prefix)
    return content_digest(dataset.sequence_lengths, dataset.document_indices)


def mapped_tokens(path: str, dtype) -> np.ndarray:
    """The whole .bin as an array, mapped, not read. Samples are read at random places: the
    kernel is told so, and reads the pages a sample needs rather than 128 kB ahead of each."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype=dtype)


class PackedSentences:
    """The packed samples of the dataset at `prefix`: `rows(samples)` reads a batch of them at
    once, samples[k] one (the reference for `rows`)."""

    def __init__(self, prefix: str, seq_len: int, cls_id: int, sep_id: int, cache_folder: str):
        self.dataset, self.prefix = IndexedDataset(prefix), prefix
        self.seq_len, self.cls_id, self.sep_id = seq_len, cls_id, sep_id
        self.pointers = self.dataset.index.sequence_pointers
        self.tokens = mapped_tokens(prefix + ".bin", self.dataset.index.dtype)
        dataset = dataset_digest(prefix, cache_folder)
        name = os.path.basename(prefix)
        started = time.time()
        self.boundaries, self.index_path, built = cached_array(
            cache_folder, f"{name}.samples-{seq_len}",
            {"rule": PACKING_RULE, "seq_len": seq_len, "dataset": dataset}, self._build)
        # megatron-core's .idx holds its int64 arrays at offsets that are not multiples of 8,
        # and numpy copies a whole unaligned array to search it: the starts go to the cache too
        self.document_starts, _, _ = cached_array(
            cache_folder, f"{name}.document-starts", {"dataset": dataset},
            lambda: np.unique(self.dataset.document_indices[1:-1]))
        if built:
            logger.info(f"tupe_ds: built the sample index of {prefix} ({len(self)} samples of "
                        f"{len(self.dataset)} sentences at seq-len {seq_len}) in "
                        f"{time.time() - started:.1f} s: {self.index_path}",
                        extra=EVERY_RANK)  # whichever rank built it

    def _build(self) -> np.ndarray:
        check_contiguous(self.dataset, self.prefix)
        return pack(self.dataset.sequence_lengths, self.dataset.document_indices,
                    self.seq_len - 2)

    def __len__(self) -> int:
        return len(self.boundaries) - 1

    def sentences(self, k: int) -> range:
        return range(int(self.boundaries[k]), int(self.boundaries[k + 1]))

    def inner_document_starts(self, first: np.ndarray, last: np.ndarray):
        """(row, start) of every document start strictly inside [first[row], last[row]),
        ordered by row."""
        low = np.searchsorted(self.document_starts, first, side="right")
        high = np.searchsorted(self.document_starts, last, side="left")
        counts = np.maximum(high - low, 0)
        row = np.repeat(np.arange(len(first)), counts)
        offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return row, self.document_starts[np.repeat(low, counts) + offset]

    def __getitem__(self, k: int) -> np.ndarray:
        """int64 token ids "[CLS] ... [SEP]", at most seq_len long, read sentence by sentence."""
        sentences = self.sentences(k)
        _, crossed = self.inner_document_starts(np.array([sentences.start]),
                                                np.array([sentences.stop]))
        pieces = [np.array([self.cls_id])]
        for sentence in sentences:
            if sentence in crossed:
                pieces.append(np.array([self.sep_id]))
            pieces.append(self.dataset[sentence])
        tokens = np.concatenate(pieces).astype(np.int64)[: self.seq_len - 1]
        return np.append(tokens, self.sep_id)

    def _spans(self, samples: np.ndarray) -> tuple:
        """(first sentence, last sentence + 1, first token, token count) of each sample."""
        first, last = self.boundaries[samples], self.boundaries[samples + 1]
        itemsize = self.dataset.index.dtype_size
        token_start = self.pointers[first] // itemsize
        token_count = (self.pointers[last - 1] // itemsize
                       + self.dataset.sequence_lengths[last - 1] - token_start)
        return first, last, token_start, token_count

    def lengths(self, samples: np.ndarray) -> np.ndarray:
        """The length of each sample in tokens, [CLS] and [SEP]s included, padding not: what
        `rows` gives with its tokens, from the index alone (no token is read)."""
        samples = np.asarray(samples, dtype=np.int64)
        first, last, _, token_count = self._spans(samples)
        inner = (np.searchsorted(self.document_starts, last, side="left")
                 - np.searchsorted(self.document_starts, first, side="right"))
        return np.minimum(1 + token_count + np.maximum(inner, 0), self.seq_len - 1) + 1

    def rows(self, samples: np.ndarray, pad: int):
        """(tokens [len(samples), seq_len] int64 padded with `pad`, lengths): samples[i] in row
        i, as samples[k] gives it, from whole-batch operations on the mapped .bin."""
        samples = np.asarray(samples, dtype=np.int64)
        batch, width = len(samples), self.seq_len
        first, last, token_start, token_count = self._spans(samples)
        itemsize = self.dataset.index.dtype_size
        # a separator before each inner document start, at its place in the output row
        row, starts = self.inner_document_starts(first, last)
        nth = np.arange(len(row)) - np.searchsorted(row, row)
        separator_at = 1 + self.pointers[starts] // itemsize - token_start[row] + nth
        content = np.minimum(1 + token_count + np.bincount(row, minlength=batch), width - 1)
        is_separator = np.zeros((batch, width + 1), dtype=bool)
        kept = separator_at < width - 1
        is_separator[row[kept], separator_at[kept]] = True
        is_separator = is_separator[:, :width]
        position = np.arange(width)
        offset = position - 1 - np.cumsum(is_separator, axis=1)  # token offset in the slice
        is_token = (position > 0) & (position < content[:, None]) & ~is_separator
        tokens = np.full((batch, width), pad, dtype=np.int64)
        tokens[is_token] = self.tokens[(token_start[:, None] + offset)[is_token]]
        tokens[is_separator] = self.sep_id
        tokens[:, 0] = self.cls_id
        tokens[np.arange(batch), content] = self.sep_id
        return tokens, content + 1
