"""Pass 1's per-document work (clean, fingerprint, sentence-split) in worker processes: the pool,
and batches of texts mapped through it in input order, a bounded number in flight."""

import collections
import contextlib
import multiprocessing
import sys
import time

import numpy as np

from data_prep.clean import Cleaner
from data_prep.config import PrepConfig
from data_prep.dedup import exact_key
from data_prep.near import band_keys, lsh_shape, shingle_hashes, signature
from data_prep.sentences import SentenceSplitter, count_words

PASS1_BATCH_DOCS = 64  # documents per worker task

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
    if count_words(clean) < config.min_words:
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
    """(tag, _process_batch(texts)) of each (tag, texts) of `batches`, in order: only the texts
    go to the workers. At most 2 x workers + 2 batches are in the workers or waiting to be read
    here, so memory does not grow with the corpus when this process (de-duplication, BPE
    counting) is slower than the workers."""
    if pool is None:
        yield from ((tag, _process_batch(texts)) for tag, texts in batches)
        return
    in_flight = collections.deque()
    for tag, texts in batches:
        if len(in_flight) == 2 * workers + 2:
            done_tag, result = in_flight.popleft()
            yield done_tag, result.get()
        in_flight.append((tag, pool.apply_async(_process_batch, (texts,))))
    while in_flight:
        done_tag, result = in_flight.popleft()
        yield done_tag, result.get()
