"""The prep run: read -> clean -> dedup -> split -> BPE -> encode -> indexed datasets + manifest.

Pass 1 streams the inputs through worker processes (cleaning, MinHash signatures, sentence
splitting) and de-duplicates in input order in this process, spooling the kept documents to disk
and feeding their sentences straight to the BPE trainer (unless a tokenizer is given). Pass 2
encodes the spool in batches (tokenizers' own threads) into megatron-core indexed datasets.
Outputs are written in a work folder and renamed into place when complete (`output.py`), so a
crash leaves no partial output and running the same command again does the work again from the
start.
"""

import array
import collections
import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict
from typing import List

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tqdm import tqdm

from data_prep.clean import Cleaner
from data_prep.config import PrepConfig
from data_prep.across import SIGNATURES, write_band_index
from data_prep.dedup import KEPT, Deduplicator, exact_key
from data_prep.near import band_keys, lsh_shape, shingle_hashes, signature, write_shingles
from data_prep.merge import filter_against, near_settings
from data_prep.output import DEDUP_STATE, SPLITS, SPOOL, publish, work_folder
from data_prep.read import InputError, Reader, expand_inputs
from data_prep.sentences import SentenceSplitter
from data_prep.tokenizer import load_tokenizer, train_tokenizer

ENCODE_BATCH_DOCS = 256
PASS1_BATCH_DOCS = 64  # documents per worker task
SOURCE_COUNTS = ("documents_in", "empty_dropped", "short_dropped", "exact_duplicates_removed",
                 "near_duplicates_removed", "cross_corpus_exact_removed",
                 "cross_corpus_near_removed", "documents_out", "sentences", "tokens")


# ---- pass 1: per-document work, in worker processes -------------------------------------------

_worker = {}


def _init_worker(config: PrepConfig) -> None:
    _worker["config"] = config
    _worker["cleaner"] = Cleaner(lowercase=config.lowercase)
    _worker["splitter"] = SentenceSplitter(config.spacy_model, config.min_sentence_words)


def _process(text: str) -> dict:
    """Clean, fingerprint and split one document; timings come back with it."""
    config = _worker["config"]
    timings = {}
    start = time.perf_counter()
    clean = _worker["cleaner"].normalize(text)
    timings["clean"] = time.perf_counter() - start
    if not clean:
        return {"drop": "empty", "seconds": timings}
    if len(clean.split()) < config.min_words:
        return {"drop": "short", "seconds": timings}
    start = time.perf_counter()
    key = exact_key(clean)
    shingles = shingle_hashes(clean, config.shingle) if config.dedup == "minhash" else None
    minhash = signature(shingles, config.num_perm) if shingles is not None else None
    timings["dedup"] = time.perf_counter() - start
    start = time.perf_counter()
    sentences = _worker["splitter"].split(clean)
    timings["split"] = time.perf_counter() - start
    return {"key": key, "signature": minhash, "shingles": shingles, "sentences": sentences,
            "seconds": timings}


def _process_batch(texts: list) -> dict:
    """_process of each text, a task's worth, packed for one pickle each way per
    PASS1_BATCH_DOCS (a numpy array per document costs more to send than to make): the results
    without their arrays, and the kept-so-far documents' signatures, LSH band keys (computed
    here, not in the de-duplicating process) and shingle hashes (one after another), an array
    each."""
    results = [_process(text) for text in texts]
    signed = [result for result in results if result.get("signature") is not None]
    packed = {"results": results}
    if signed:
        start = time.perf_counter()
        config = _worker["config"]
        packed["signatures"] = np.stack([result.pop("signature") for result in signed])
        packed["bands"] = band_keys(packed["signatures"],
                                    *lsh_shape(config.jaccard_threshold, config.num_perm)).T
        shingles = [result.pop("shingles") for result in signed]
        packed["shingle_ends"] = np.cumsum([len(s) for s in shingles])
        packed["shingles"] = np.concatenate(shingles)
        signed[0]["seconds"]["dedup"] += time.perf_counter() - start
    return packed


@contextlib.contextmanager
def worker_pool(config: PrepConfig):
    """The pass-1 workers (None: this process does their work). They are forked (on Linux)
    after _init_worker, so they share its spaCy pipeline, and from the thread that calls this:
    the main one, before tokenizers starts threads of its own."""
    _init_worker(config)
    if config.workers == 1:
        yield None
        return
    fork = sys.platform == "linux"
    context = multiprocessing.get_context("fork" if fork else "spawn")
    with context.Pool(config.workers, initializer=None if fork else _init_worker,
                      initargs=() if fork else (config,)) as pool:
        yield pool


def _map(pool, workers: int, batches):
    """_process_batch of each batch of texts, in order. At most 2 x workers + 2 batches are in
    the workers or waiting to be read here, so memory does not grow with the corpus when this
    process (de-duplication, BPE counting) is slower than the workers."""
    if pool is None:
        yield from map(_process_batch, batches)
        return
    in_flight = collections.deque()
    for batch in batches:
        if len(in_flight) == 2 * workers + 2:
            yield in_flight.popleft().get()
        in_flight.append(pool.apply_async(_process_batch, (batch,)))
    while in_flight:
        yield in_flight.popleft().get()


# ---- the run ----------------------------------------------------------------------------------


def prepare(config: PrepConfig) -> dict:
    """Run every stage; returns the manifest (also written to OUTPUT/manifest.json)."""
    config.validate()
    files = config.shard_files(expand_inputs(config.inputs))
    with work_folder(config.output) as work:
        return _prepare(config, files, work)


def _prepare(config: PrepConfig, files: List[str], work: str) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", str(config.workers))  # tokenizers' threads
    started = time.perf_counter()
    manifest = {"inputs": files,
                "config": {k: v for k, v in asdict(config).items() if k != "inputs"}}
    seconds = {"clean": 0.0, "dedup": 0.0, "split": 0.0}

    reader = Reader(config.text_key, config.txt_documents, config.skip_bad_lines)
    os.makedirs(os.path.join(work, DEDUP_STATE))
    dedup = Deduplicator(config.dedup, config.jaccard_threshold, config.num_perm,
                         os.path.join(work, DEDUP_STATE))
    counts = {"documents_in": 0, "empty_dropped": 0, "short_dropped": 0, "documents_out": 0,
              "sentences": 0}
    source_of = {path: given for given in config.inputs for path in expand_inputs([given])}
    per_source = {given: dict.fromkeys(SOURCE_COUNTS, 0) for given in config.inputs
                  if any(source_of.get(path) == given for path in files)}
    spool_path = os.path.join(work, SPOOL)
    pass_start = time.perf_counter()

    def kept_sentences():
        """Pass 1: spools the kept documents and yields their sentences (a list per batch), so
        that BPE training counts words while the workers clean and split."""
        with open(spool_path, "w", encoding="utf-8") as spool:
            waiting = collections.deque()  # each batch's sources, until its results are back

            def batches():
                """The texts of PASS1_BATCH_DOCS documents at a time (only texts go to the
                workers)."""
                sources, texts = [], []
                for path in files:
                    for document in reader.documents([path]):
                        sources.append(source_of[path])
                        texts.append(document.text)
                        if len(texts) == PASS1_BATCH_DOCS:
                            waiting.append(sources)
                            yield texts
                            sources, texts = [], []
                if texts:
                    waiting.append(sources)
                    yield texts

            progress = tqdm(desc="clean, dedup, split", unit=" docs", disable=config.quiet)
            for packed in _map(pool, config.workers, batches()):
                results = packed["results"]
                sources = waiting.popleft()
                progress.update(len(results))
                counts["documents_in"] += len(results)
                for source, result in zip(sources, results):
                    per_source[source]["documents_in"] += 1
                    for stage, value in result["seconds"].items():
                        seconds[stage] += value
                    if "drop" in result:
                        counts[f"{result['drop']}_dropped"] += 1
                        per_source[source][f"{result['drop']}_dropped"] += 1
                live = [(source, result) for source, result in zip(sources, results)
                        if "key" in result]
                start = time.perf_counter()
                verdicts = dedup.judge(
                    [result["key"] for _, result in live], packed.get("signatures"),
                    np.split(packed["shingles"], packed["shingle_ends"][:-1])
                    if "shingles" in packed else None, packed.get("bands"))
                seconds["dedup"] += time.perf_counter() - start
                kept = []  # the batch's kept sentences: one item for the BPE trainer
                for (source, result), verdict in zip(live, verdicts):
                    if verdict != KEPT:
                        per_source[source][f"{verdict}_duplicates_removed"] += 1
                        continue
                    counts["documents_out"] += 1
                    counts["sentences"] += len(result["sentences"])
                    spool.write(json.dumps({"key": result["key"], "source": source,
                                            "sentences": result["sentences"]}) + "\n")
                    kept += result["sentences"]
                yield kept
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
    if counts["documents_out"] == 0:
        raise InputError(f"no document left to write from {len(files)} input file(s) "
                         f"({counts['documents_in']} read, {counts['empty_dropped']} empty, "
                         f"{counts['short_dropped']} shorter than --min-words {config.min_words})")

    def spooled():
        with open(spool_path, encoding="utf-8") as f:
            for row, line in enumerate(f):
                yield {**json.loads(line), "row": row}

    tokenizer.save(os.path.join(work, "tokenizer.json"))

    start = time.perf_counter()
    vocab = tokenizer.get_vocab_size()
    dtype = DType.optimal_dtype(vocab)
    builders = {split: IndexedDatasetBuilder(os.path.join(work, f"{split}.bin"), dtype=dtype)
                for split in SPLITS}
    sources = {name: index for index, name in enumerate(per_source)}
    written = {split: Written() for split in SPLITS}
    progress = tqdm(total=counts["documents_out"], desc="encode", unit=" docs",
                    disable=config.quiet)
    batch = []
    for document in spooled():
        batch.append(document)
        if len(batch) == ENCODE_BATCH_DOCS:
            _encode(batch, tokenizer, config, builders, sources, written)
            progress.update(len(batch))
            batch = []
    _encode(batch, tokenizer, config, builders, sources, written)
    progress.update(len(batch))
    progress.close()
    for split in SPLITS:
        builders[split].finalize(os.path.join(work, f"{split}.idx"))
        np.save(os.path.join(work, f"{split}.keys.npy"), written[split].column("keys"))
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
    counts["documents_out"] = sum(c["documents"] for c in split_counts.values())
    counts["sentences"] = sum(c["sentences"] for c in split_counts.values())
    seconds["total"] = time.perf_counter() - started

    manifest.update(
        counts,
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


def write_near_files(work: str, dedup: Deduplicator, written: dict, config: PrepConfig,
                     chunk: int = 4096) -> None:
    """Each split's signatures, shingles and band index (data_prep/across.py), from the
    deduplicator's files of every kept document's signature and shingles."""
    spooled, ends = dedup.signatures.sync(), dedup.shingle_ends.sync()
    starts = np.concatenate([[0], ends[:-1]])
    for split in SPLITS:
        order = written[split].column("rows")
        prefix = os.path.join(work, split)
        signatures = np.lib.format.open_memmap(f"{prefix}.{SIGNATURES}", mode="w+",
                                               dtype=np.uint32, shape=(len(order), config.num_perm))
        for start in range(0, len(order), chunk):
            signatures[start:start + chunk] = spooled[order[start:start + chunk]]
        signatures.flush()
        write_shingles(prefix, (dedup.shingles_of(row) for row in order),
                       int((ends[order] - starts[order]).sum()), len(order))
        write_band_index(prefix, signatures, config.jaccard_threshold, config.num_perm)
        del signatures


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
        split_counts[split] = {"documents": int(kept.sum()), "sentences": int(sentences[kept].sum()),
                               "tokens": int(tokens[kept].sum())}
    return split_counts
