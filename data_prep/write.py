"""Stage 5, writing: each kept document's token ids into its split's indexed dataset, and what
was written (`Written`) for the counts and the near-duplicate files of each split."""

import array
import itertools
import json
import os

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tupe_ds.tools.progress_bar import Bar

from data_prep import across
from data_prep.config import PrepConfig
from data_prep.dedup import Deduplicator
from data_prep.output import SPLITS

ENCODE_BATCH_DOCS = 256


def encode_spool(spool_path: str, tokenizer, dtype, config: PrepConfig, work: str, sources: dict,
                 total: int) -> dict:
    """Pass 2: the spooled documents encoded, ENCODE_BATCH_DOCS at a time, into each split's
    indexed dataset and its keys (WORK/{split}.bin, .idx, .keys.npy); returns each split's
    `Written`."""
    builders = {split: IndexedDatasetBuilder(os.path.join(work, f"{split}.bin"), dtype=dtype)
                for split in SPLITS}
    written = {split: Written() for split in SPLITS}
    progress = Bar(total=total, desc="encode", unit=" docs", disable=config.quiet)
    with open(spool_path, encoding="utf-8") as spool:
        documents = ({**json.loads(line), "row": row} for row, line in enumerate(spool))
        while batch := list(itertools.islice(documents, ENCODE_BATCH_DOCS)):
            _encode(batch, tokenizer, config, builders, sources, written)
            progress.update(len(batch))
    progress.close()
    for split in SPLITS:
        builders[split].finalize(os.path.join(work, f"{split}.idx"))
        np.save(os.path.join(work, f"{split}.keys.npy"), written[split].column("keys"))
    return written


def write_near_files(work: str, dedup: Deduplicator, written: dict, config: PrepConfig) -> None:
    """Each split's signatures, shingles and band index (data_prep/across.py), from the
    deduplicator's files of every kept document's signature and shingles."""
    spooled, ends = dedup.signatures.sync(), dedup.shingle_ends.sync()
    starts = np.concatenate([[0], ends[:-1]])
    for split in SPLITS:
        order = written[split].column("rows")
        across.write_near_files(os.path.join(work, split), [(spooled, order)],
                                (dedup.shingles_of(row) for row in order),
                                int((ends[order] - starts[order]).sum()),
                                config.jaccard_threshold, config.num_perm)


class Written:
    """One split's documents as written, in order: their keys, places in the spool, sources
    (indices), sentences and tokens, in compact columns (32 bytes a document)."""

    TYPES = {"keys": "Q", "rows": "q", "sources": "I", "sentences": "I", "tokens": "Q"}

    def __init__(self):
        self.columns = {name: array.array(code) for name, code in self.TYPES.items()}

    def add(self, **values) -> None:
        for name, value in values.items():
            self.columns[name].append(value)

    def column(self, name: str) -> np.ndarray:
        return np.array(self.columns[name], dtype=self.TYPES[name])


def _encode(batch, tokenizer, config, builders, sources: dict, written: dict) -> None:
    sentences = [s for document in batch for s in document["sentences"]]
    encoded = iter(tokenizer.encode_batch(sentences, add_special_tokens=False))
    for document in batch:
        ids = [next(encoded).ids for _ in document["sentences"]]
        split = "valid" if (document["key"] >> 11) / 2**53 < config.valid_fraction else "train"
        # the document's token ids (made a numpy array there) and its sentence lengths
        lengths = [len(s) for s in ids]
        builders[split].add_document([t for s in ids for t in s], lengths)
        written[split].add(keys=document["key"], rows=document["row"],
                           sources=sources[document["source"]], sentences=len(ids),
                           tokens=sum(lengths))


def count_written(written: dict, sources: list, per_source: dict, removed: dict) -> dict:
    """Each split's counts (documents, sentences, tokens) of the documents `written` and not
    `removed` (split -> what --dedup-against took, or nothing), added to each source's counts
    (`sources`: their names and the numbers `written` has for them) with what it lost to other
    corpora."""
    split_counts = {}
    for split, documents in written.items():
        source = documents.column("sources")
        gone = removed.get(split)
        kept = np.ones(len(source), bool) if gone is None else ~gone.any
        sentences, tokens = documents.column("sentences"), documents.column("tokens")
        for name, index in sources.items():
            mine, counts = source == index, per_source[name]
            if gone is not None:
                counts["cross_corpus_exact_removed"] += int((mine & gone.any & gone.exact).sum())
                counts["cross_corpus_near_removed"] += int((mine & gone.any & ~gone.exact).sum())
            counts["documents_out"] += int((mine & kept).sum())
            counts["sentences"] += int(sentences[mine & kept].sum())
            counts["tokens"] += int(tokens[mine & kept].sum())
        split_counts[split] = {"documents": int(kept.sum()),
                               "sentences": int(sentences[kept].sum()),
                               "tokens": int(tokens[kept].sum())}
    return split_counts
