"""The prep run: read -> clean -> dedup -> split -> BPE -> encode -> indexed datasets + manifest.

Pass 1 streams the inputs through worker processes (`workers.py`: cleaning, MinHash signatures,
sentence splitting) and de-duplicates in input order in this process, spooling the kept documents
to disk and feeding their sentences straight to the BPE trainer (unless a tokenizer is given).
Pass 2 encodes the spool in batches (tokenizers' own threads) into megatron-core indexed datasets
(`write.py`). Outputs are written in a work folder and renamed into place when complete
(`output.py`), so a crash leaves no partial output and running the same command again does the
work again from the start.
"""

import itertools
import json
import os
import sys
import time
from dataclasses import asdict
from typing import List

import numpy as np
from megatron.core.datasets.indexed_dataset import DType
from tupe_ds.tools.progress_bar import Bar

from data_prep.config import PrepConfig
from data_prep.dedup import KEPT, Deduplicator
from data_prep.merge import filter_against, near_settings
from data_prep.output import CLEANING_VERSION, DEDUP_STATE, SPOOL, publish, work_folder
from data_prep.read import InputError, Reader, expand_inputs
from data_prep.tokenizer import load_tokenizer, train_tokenizer
from data_prep.workers import PASS1_BATCH_DOCS, _map, worker_pool
from data_prep.write import count_written, encode_spool, write_near_files

SOURCE_COUNTS = ("documents_in", "empty_dropped", "short_dropped", "exact_duplicates_removed",
                 "near_duplicates_removed", "cross_corpus_exact_removed",
                 "cross_corpus_near_removed", "documents_out", "sentences", "tokens")


def prepare(config: PrepConfig) -> dict:
    """Run every stage; returns the manifest (also written to OUTPUT/manifest.json)."""
    config.validate()
    files = config.shard_files(expand_inputs(config.inputs))
    with work_folder(config.output) as work:
        return _prepare(config, files, work)


def _prepare(config: PrepConfig, files: List[str], work: str) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", str(config.workers))  # tokenizers' threads
    started = time.perf_counter()
    manifest = {"inputs": files, "cleaning_version": CLEANING_VERSION,
                "config": {k: v for k, v in asdict(config).items() if k != "inputs"}}
    seconds = {"clean": 0.0, "dedup": 0.0, "split": 0.0}

    reader = Reader(config.text_key, config.txt_documents, config.skip_bad_lines)
    os.makedirs(os.path.join(work, DEDUP_STATE))
    dedup = Deduplicator(config.dedup, config.jaccard_threshold, config.num_perm,
                         os.path.join(work, DEDUP_STATE))
    source_of = {path: given for given in config.inputs for path in expand_inputs([given])}
    per_source = {given: dict.fromkeys(SOURCE_COUNTS, 0) for given in config.inputs
                  if any(source_of.get(path) == given for path in files)}
    spool_path = os.path.join(work, SPOOL)
    pass_start = time.perf_counter()

    def kept_sentences():
        """Pass 1: spools the kept documents and yields their sentences (a list per batch), so
        that BPE training counts words while the workers clean and split."""
        with open(spool_path, "w", encoding="utf-8") as spool:
            progress = Bar(desc="clean, dedup, split", unit=" docs", disable=config.quiet)
            for sources, packed in _map(pool, config.workers, _batches(files, reader, source_of)):
                progress.update(len(packed["results"]))
                live = _count_results(packed["results"], sources, per_source, seconds)
                start = time.perf_counter()
                shingles = packed.get("shingles")  # as workers._process_batch packed them
                verdicts = dedup.judge(
                    [result["key"] for _, result in live], packed.get("signatures"),
                    None if shingles is None else np.split(shingles, packed["shingle_ends"][:-1]),
                    packed.get("bands"))
                seconds["dedup"] += time.perf_counter() - start
                yield _spool_kept(live, verdicts, spool, per_source)
            progress.close()
        seconds["read_clean_dedup_split_wall"] = time.perf_counter() - pass_start
        if not config.tokenizer and not config.quiet:  # what the wait after the pass is
            print(f"BPE: computing the merges of a {config.vocab_size:,}-token vocabulary",
                  file=sys.stderr)

    with worker_pool(config) as pool:
        if config.tokenizer:
            tokenizer = load_tokenizer(config.tokenizer)
            for _ in kept_sentences():
                pass
        else:
            # Pass 1's bar counts what the trainer is fed: the trainer's own bars, drawn on a
            # terminal at the same time, would overwrite it (its merges are announced instead).
            tokenizer = train_tokenizer(kept_sentences(), config.vocab_size,
                                        config.min_frequency, show_progress=False)
    seconds["train_bpe_after_pass"] = time.perf_counter() - pass_start - seconds[
        "read_clean_dedup_split_wall"]
    counts = {name: sum(source[name] for source in per_source.values())
              for name in ("documents_in", "empty_dropped", "short_dropped")}
    if dedup.kept == 0:
        raise InputError(f"no document left to write from {len(files)} input file(s) "
                         f"({counts['documents_in']} read, {counts['empty_dropped']} empty, "
                         f"{counts['short_dropped']} shorter than --min-words {config.min_words})")

    tokenizer.save(os.path.join(work, "tokenizer.json"))

    start = time.perf_counter()
    vocab = tokenizer.get_vocab_size()
    dtype = DType.optimal_dtype(vocab)
    sources = {name: index for index, name in enumerate(per_source)}
    written = encode_spool(spool_path, tokenizer, dtype, config, work, sources, dedup.kept)
    if config.dedup == "minhash":
        write_near_files(work, dedup, written, config)
    seconds["encode_write"] = time.perf_counter() - start
    against, removed = {}, {}
    if config.dedup_against:
        start = time.perf_counter()
        near = near_settings([config.output], [{"config": asdict(config)}],
                             config.dedup_against)
        against, removed = filter_against(work, config.dedup_against, near, np.dtype(dtype),
                                          config.quiet)
        seconds["dedup_against"] = time.perf_counter() - start
    split_counts = count_written(written, sources, per_source, removed)
    seconds["total"] = time.perf_counter() - started

    manifest.update(
        counts,
        documents_out=sum(c["documents"] for c in split_counts.values()),
        sentences=sum(c["sentences"] for c in split_counts.values()),
        bytes_in=reader.stats.bytes_in,
        exact_duplicates_removed=dedup.exact_removed + against.get(
            "cross_corpus_exact_duplicates_removed", 0),
        near_duplicates_removed=dedup.near_removed + against.get(
            "cross_corpus_near_duplicates_removed", 0),
        invalid_utf8_lines=reader.stats.invalid_utf8_lines,
        invalid_utf8_examples=reader.stats.invalid_utf8_examples,
        bad_lines_skipped=reader.stats.bad_lines_skipped,
        empty_files=reader.stats.empty_files,
        tokens=sum(c["tokens"] for c in split_counts.values()),
        splits=split_counts,
        vocab_size=vocab,
        dtype=np.dtype(dtype).name,
        seconds={k: round(v, 3) for k, v in seconds.items()},
        sources=per_source,
        **against,
    )
    publish(work, config.output, manifest)
    return manifest


def _batches(files: List[str], reader: Reader, source_of: dict):
    """(sources, texts) of PASS1_BATCH_DOCS documents at a time."""
    documents = ((source_of[path], text) for path in files for text in reader.documents([path]))
    while batch := list(itertools.islice(documents, PASS1_BATCH_DOCS)):
        sources, texts = zip(*batch)
        yield sources, texts


def _count_results(results: list, sources: list, per_source: dict, seconds: dict) -> list:
    """A batch's documents counted in, and dropped, by source, with their stages' seconds;
    returns the (source, result) of those left to de-duplicate."""
    for source, result in zip(sources, results):
        per_source[source]["documents_in"] += 1
        for stage, value in result["seconds"].items():
            seconds[stage] += value
        if "drop" in result:
            per_source[source][f"{result['drop']}_dropped"] += 1
    return [(source, result) for source, result in zip(sources, results) if "key" in result]


def _spool_kept(live: list, verdicts: list, spool, per_source: dict) -> list:
    """The kept documents written to the spool (a JSON line each), and the removed ones counted
    by source; returns the kept documents' sentences: one item for the BPE trainer."""
    kept = []
    for (source, result), verdict in zip(live, verdicts):
        if verdict != KEPT:
            per_source[source][f"{verdict}_duplicates_removed"] += 1
            continue
        spool.write(json.dumps({"key": result["key"], "source": source,
                                "sentences": result["sentences"]}) + "\n")
        kept += result["sentences"]
    return kept
