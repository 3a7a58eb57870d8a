"""tupe-prep merge: shard outputs -> one dataset, with exact de-duplication across shards.

Shards are appended in the order given with megatron-core's IndexedDatasetBuilder.add_index;
a shard holding a document already seen in an earlier shard is copied document by document
without it instead.
"""

import json
import os
import shutil
import time
from typing import List

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from data_prep.output import SPLITS, publish, work_folder
from tupe_ds.files import file_digest

SUMMED = ("documents_in", "empty_dropped", "short_dropped", "exact_duplicates_removed",
          "near_duplicates_removed", "invalid_utf8_lines", "bad_lines_skipped", "bytes_in")


def read_manifest(shard: str) -> dict:
    path = os.path.join(shard, "manifest.json")
    if not os.path.exists(path):
        raise ValueError(f"{shard}: no manifest.json, so the shard is missing or unfinished; "
                         "re-run its tupe-prep --shard command")
    with open(path) as f:
        return json.load(f)


def merge(shards: List[str], output: str, quiet: bool = False) -> dict:
    if not shards:
        raise ValueError("merge: name at least one shard folder")
    manifests = [read_manifest(shard) for shard in shards]
    tokenizers = {file_digest(os.path.join(shard, "tokenizer.json")) for shard in shards}
    if len(tokenizers) != 1:
        raise ValueError("merge: the shards were encoded with different tokenizers; "
                         "run every shard with the same --tokenizer FILE")
    dtypes = {m["dtype"] for m in manifests}
    if len(dtypes) != 1:
        raise ValueError(f"merge: the shards have different token dtypes {sorted(dtypes)}")
    started = time.perf_counter()
    with work_folder(output) as work:
        return _merge(shards, manifests, output, work, started, quiet)


def _merge(shards, manifests, output, work, started, quiet) -> dict:
    shutil.copyfile(os.path.join(shards[0], "tokenizer.json"), os.path.join(work, "tokenizer.json"))

    removed = 0
    split_counts = {}
    for split in SPLITS:
        builder = IndexedDatasetBuilder(os.path.join(work, f"{split}.bin"),
                                        dtype=np.dtype(manifests[0]["dtype"]).type)
        seen, kept_keys = set(), []
        counts = {"documents": 0, "sentences": 0, "tokens": 0}
        for shard in tqdm(shards, desc=f"merge {split}", unit=" shards", disable=quiet):
            prefix = os.path.join(shard, split)
            keys = np.load(f"{prefix}.keys.npy")
            if len(keys) == 0:  # an empty .bin cannot be memory-mapped
                continue
            duplicate = np.array([int(k) in seen for k in keys], dtype=bool)
            seen.update(int(k) for k in keys)
            dataset = IndexedDataset(prefix)
            documents = dataset.document_indices
            lengths = dataset.sequence_lengths
            if not duplicate.any():
                builder.add_index(prefix)
                kept = np.arange(len(keys))
            else:
                kept = np.flatnonzero(~duplicate)
                for doc in kept:
                    first, last = documents[doc], documents[doc + 1]
                    tokens = np.concatenate([dataset[i] for i in range(first, last)])
                    builder.add_document(torch.from_numpy(tokens.astype(np.int64)),
                                         lengths[first:last].tolist())
            removed += int(duplicate.sum())
            kept_keys.extend(keys[kept].tolist())
            counts["documents"] += len(kept)
            for doc in kept:
                counts["sentences"] += int(documents[doc + 1] - documents[doc])
                counts["tokens"] += int(lengths[documents[doc]:documents[doc + 1]].sum())
        builder.finalize(os.path.join(work, f"{split}.idx"))
        np.save(os.path.join(work, f"{split}.keys.npy"), np.array(kept_keys, dtype=np.uint64))
        split_counts[split] = counts

    manifest = {key: sum(m[key] for m in manifests) for key in SUMMED}
    manifest.update(
        shards=shards,
        cross_shard_duplicates_removed=removed,
        documents_out=sum(c["documents"] for c in split_counts.values()),
        sentences=sum(c["sentences"] for c in split_counts.values()),
        tokens=sum(c["tokens"] for c in split_counts.values()),
        splits=split_counts,
        vocab_size=manifests[0]["vocab_size"],
        dtype=manifests[0]["dtype"],
        seconds={"merge": round(time.perf_counter() - started, 3)},
    )
    manifest["exact_duplicates_removed"] += removed
    publish(work, output, manifest)
    return manifest
