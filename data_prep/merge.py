"""tupe-prep merge: shard outputs -> one dataset, de-duplicated across the shards (exact and, when
the shards were prepared with --dedup minhash, near duplicates: data_prep/across.py) and, with
--dedup-against, against corpora already prepared. A document stays in the first place it
appears: the corpora de-duplicated against first, then the shards in the order given.

A shard that loses nothing is appended with megatron-core's IndexedDatasetBuilder.add_index; one
that loses documents is copied document by document without them. `filter_against` does the
same to one run's own output (tupe-prep --dedup-against).
"""

import logging
import os
import shutil
import time
from typing import List, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tupe_ds.tools.progress_bar import Bar

from data_prep import across
from data_prep.near import ShingleFile, lsh_shape
from data_prep.output import (SPLITS, check_cleaning_versions, cleaning_version, publish,
                              read_manifest, work_folder)
from tupe_ds.tools.files import file_digest

logger = logging.getLogger(__name__)

SUMMED = ("documents_in", "empty_dropped", "short_dropped", "exact_duplicates_removed",
          "near_duplicates_removed", "invalid_utf8_lines", "bad_lines_skipped", "bytes_in")


def merge(shards: List[str], output: str, quiet: bool = False,
          dedup_against: Sequence[str] = ()) -> dict:
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
    version = check_cleaning_versions(
        {folder: cleaning_version(folder, manifest) for folder, manifest in
         [*zip(shards, manifests), *((f, read_manifest(f)) for f in dedup_against)]}, "merge")
    near = near_settings(shards, manifests, dedup_against)
    started = time.perf_counter()
    with work_folder(output) as work:
        shutil.copyfile(os.path.join(shards[0], "tokenizer.json"),
                        os.path.join(work, "tokenizer.json"))
        kept, split_counts = write_deduplicated(
            shards, work, np.dtype(manifests[0]["dtype"]), dedup_against, near, quiet)
        manifest = {key: sum(m[key] for m in manifests) for key in SUMMED}
        manifest.update(config={name: manifests[0]["config"][name] for name in NEAR_SETTINGS}
                        if near else {"dedup": "exact"},
                        cleaning_version=version, shards=shards, splits=split_counts,
                        vocab_size=manifests[0]["vocab_size"],
                        dtype=manifests[0]["dtype"],
                        seconds={"merge": round(time.perf_counter() - started, 3)})
        manifest.update(across_counts(kept, split_counts, dedup_against, near))
        for kind in ("exact", "near"):
            manifest[f"{kind}_duplicates_removed"] += sum(
                manifest[f"cross_{by}_{kind}_duplicates_removed"] for by in ("shard", "corpus"))
        publish(work, output, manifest)
    return manifest


NEAR_SETTINGS = ("dedup", "jaccard_threshold", "num_perm", "shingle")


def near_settings(folders: Sequence[str], manifests: List[dict], against: Sequence[str]):
    """(threshold, num_perm) when every folder, and every corpus de-duplicated against, was
    prepared (or merged) with --dedup minhash at one setting: then near duplicates are removed
    across them. Else None (exact ones only), said in one line unless no folder has them."""
    configs = {folder: m.get("config", {}) for folder, m in zip(folders, manifests)}
    configs.update({folder: read_manifest(folder).get("config", {}) for folder in against})
    without = [folder for folder, c in configs.items() if c.get("dedup") != "minhash"]
    if without:
        if against:
            raise ValueError("--dedup-against needs folders prepared with --dedup minhash; "
                             + ", ".join(f"{folder} has --dedup {configs[folder].get('dedup', '?')}"
                                         for folder in without))
        if len(without) < len(configs):
            logger.warning(f"merge: near duplicates across the folders are not removed, exact ones "
                           f"only: {', '.join(without)} had no --dedup minhash")
        return None
    settings = {tuple(c.get(name) for name in NEAR_SETTINGS[1:]) for c in configs.values()}
    if len(settings) != 1:
        raise ValueError("merge: the folders were prepared with different --jaccard-threshold / "
                         f"--num-perm / --shingle {sorted(settings)}; near duplicates across "
                         "them need one")
    threshold, num_perm, _ = settings.pop()
    return threshold, num_perm


def parts_of(shards: Sequence[str], against: Sequence[str], near) -> List[across.Part]:
    """The splits of each folder together: the corpora de-duplicated against, then the shards
    in order. So a document goes when an earlier folder has it, in whichever split: the first
    copy in input order stays, as in one run over all the inputs (the shards hold consecutive
    inputs, in order, and each run de-duplicated its own splits together)."""
    folders = [(folder, True) for folder in against] + [(shard, False) for shard in shards]
    parts = [across.Part(os.path.join(folder, split), fixed=fixed, same_folder=split != SPLITS[0])
             for folder, fixed in folders for split in SPLITS]
    for part in parts:
        if not os.path.exists(f"{part.prefix}.keys.npy"):
            raise ValueError(f"{part.prefix}.keys.npy: missing; name folders written by tupe-prep")
    if near is not None:
        threshold, num_perm = near
        across.check_near_files(parts, num_perm, lsh_shape(threshold, num_perm)[0])
    return parts


def write_deduplicated(folders, work, dtype, against, near, quiet):
    """The documents of `folders` (shards, in order) less those found again, into
    work/SPLIT.*: (per part of `folders`: (part, what it lost, its counts kept)), each split's
    counts)."""
    parts = parts_of(folders, against, near)
    threshold, num_perm = near or (0.0, 0)
    removed = across.duplicates(parts, threshold, num_perm, near=near is not None, quiet=quiet)
    mine = [(part, gone) for part, gone in zip(parts, removed) if not part.fixed]
    kept, split_counts = [], {}
    for split in SPLITS:
        chosen = [(part, gone) for part, gone in mine if part.prefix.endswith(os.sep + split)]
        counts = write_kept([(part.prefix, ~gone.any) for part, gone in chosen],
                            os.path.join(work, split), dtype, near, quiet)
        kept += [(part, gone, count) for (part, gone), count in zip(chosen, counts)]
        split_counts[split] = {key: sum(count[key] for count in counts)
                               for key in ("documents", "sentences", "tokens")}
    return kept, split_counts


def write_kept(sources, prefix: str, dtype, near, quiet: bool) -> list:
    """The documents of each (source prefix, kept mask), in order, as one indexed dataset at
    `prefix` with its .keys.npy (and, with `near` settings, its near-duplicate files); returns
    each source's counts of what it gave (documents, sentences, tokens)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype.type)
    keys, kept_rows, counts = [], [], []
    progress = Bar(total=sum(int(kept.sum()) for _, kept in sources), unit=" docs",
                   desc=f"merge {os.path.basename(prefix)}", disable=quiet)
    for source, kept in sources:
        keys.append(np.load(f"{source}.keys.npy")[kept])
        kept_rows.append(np.flatnonzero(kept))
        counts.append({"documents": int(kept.sum()), "sentences": 0, "tokens": 0})
        if not kept.any():
            continue
        dataset = IndexedDataset(source)
        documents, lengths = dataset.document_indices, dataset.sequence_lengths
        if kept.all():
            builder.add_index(source)
            progress.update(len(kept))
        else:
            for doc in kept_rows[-1]:
                first, last = documents[doc], documents[doc + 1]
                tokens = np.concatenate([dataset[i] for i in range(first, last)])
                # the array as it is: megatron-core converts it to the builder's dtype (a
                # torch tensor there makes numpy warn that its __array__ takes no copy=)
                builder.add_document(tokens, lengths[first:last].tolist())
                progress.update()
        starts, ends = documents[:-1][kept], documents[1:][kept]
        counts[-1]["sentences"] = int((ends - starts).sum())
        counts[-1]["tokens"] = int(sum(int(lengths[a:b].sum()) for a, b in zip(starts, ends)))
    progress.close()
    builder.finalize(f"{prefix}.idx")
    np.save(f"{prefix}.keys.npy", np.concatenate(keys).astype(np.uint64))
    if near is not None:  # the shingles, a document at a time, take most of it: a progress bar
        shingles = [(ShingleFile(source), rows) for (source, _), rows in zip(sources, kept_rows)]
        across.write_near_files(
            prefix, [(np.load(f"{source}.{across.SIGNATURES}", mmap_mode="r"), rows)
                     for (source, _), rows in zip(sources, kept_rows)],
            Bar((file[row] for file, rows in shingles for row in rows),
                total=sum(count["documents"] for count in counts),
                desc=f"{os.path.basename(prefix)} shingles", unit=" docs", disable=quiet),
            sum(int((file.offsets[rows + 1] - file.offsets[rows]).sum())
                for file, rows in shingles), *near)
    return counts


def filter_against(work: str, against: Sequence[str], near, dtype, quiet: bool) -> tuple:
    """One run's output in `work` less the documents found in the corpora `against` (tupe-prep
    --dedup-against): (the counts of across_counts but per folder, split -> what it lost)."""
    staged = os.path.join(work, "against")
    os.makedirs(staged)
    kept, split_counts = write_deduplicated([work], staged, dtype, against, near, quiet)
    for name in os.listdir(staged):
        os.replace(os.path.join(staged, name), os.path.join(work, name))
    os.rmdir(staged)
    counts = across_counts(kept, split_counts, against, near)
    for name in ("sources", "documents_out", "sentences", "tokens"):
        counts.pop(name)  # the run counts its own
    return counts, {os.path.basename(part.prefix): gone for part, gone, _ in kept}


def across_counts(kept, split_counts, against, near) -> dict:
    """The manifest's counts of what the de-duplication across folders removed: in total, and
    per folder (its documents in, what it lost as exact or near duplicates of an earlier
    folder's, by a shard or by another corpus, and what it gave: documents, sentences, tokens)."""
    per_folder = {}
    for part, gone, given in kept:
        counts = per_folder.setdefault(os.path.dirname(part.prefix), {
            "documents_in": 0, "cross_shard_exact_removed": 0, "cross_shard_near_removed": 0,
            "cross_corpus_exact_removed": 0, "cross_corpus_near_removed": 0,
            "documents_out": 0, "sentences": 0, "tokens": 0})
        for kind, mask, by_corpus in (("exact", gone.exact, gone.exact_by_fixed),
                                      ("near", gone.near, gone.near_by_fixed)):
            counts[f"cross_corpus_{kind}_removed"] += by_corpus
            counts[f"cross_shard_{kind}_removed"] += int(mask.sum()) - by_corpus
        counts["documents_in"] += len(gone.exact)
        counts["documents_out"] += given["documents"]
        counts["sentences"] += given["sentences"]
        counts["tokens"] += given["tokens"]
    totals = {f"cross_{by}_{kind}_duplicates_removed": sum(
        counts[f"cross_{by}_{kind}_removed"] for counts in per_folder.values())
        for by in ("shard", "corpus") for kind in ("exact", "near")}
    return {**totals, "near_duplicates_across": near is not None,
            "dedup_against": list(against), "sources": per_folder,
            "documents_out": sum(c["documents"] for c in split_counts.values()),
            "sentences": sum(c["sentences"] for c in split_counts.values()),
            "tokens": sum(c["tokens"] for c in split_counts.values())}
