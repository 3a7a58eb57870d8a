"""tupe-prep's options (`PrepConfig`), checked before any input is read, and the input files
of one shard."""

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from data_prep.output import (CLEANING_VERSION, check_cleaning_versions, cleaning_version,
                              read_manifest)


@dataclass
class PrepConfig:
    """One tupe-prep run: tupe-prep's flags (data_prep/cli.py), or set from Python."""
    inputs: List[str]
    output: str
    vocab_size: int = 32768
    min_frequency: int = 2
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    lowercase: bool = False
    dedup: str = "minhash"
    jaccard_threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5
    text_key: str = "text"
    txt_documents: str = "blank-line"
    tokenizer: Optional[str] = None
    valid_fraction: float = 0.01
    min_words: int = 5
    min_sentence_words: int = 4
    spacy_model: str = ""
    skip_bad_lines: bool = False
    shard: Optional[Tuple[int, int]] = None
    dedup_against: Tuple[str, ...] = ()
    quiet: bool = False

    def validate(self) -> None:
        def fail(option, message):
            raise ValueError(f"{option}: {message}")

        if self.vocab_size < 300:
            fail("--vocab-size", f"{self.vocab_size} is too small for byte-level BPE (>= 300)")
        if self.vocab_size >= 2**31:  # the indexed data holds token ids as int32 at most
            fail("--vocab-size", f"{self.vocab_size} is more than token ids hold (< 2**31)")
        for option, count in (("--min-frequency", self.min_frequency),
                              ("--min-words", self.min_words),
                              ("--min-sentence-words", self.min_sentence_words)):
            if count < 0:
                fail(option, f"must be 0 or more, got {count}")
        if self.workers < 1:
            fail("--workers", f"must be at least 1, got {self.workers}")
        if self.dedup not in ("exact", "minhash", "none"):
            fail("--dedup", f"choose exact, minhash or none, not {self.dedup!r}")
        if not 0 < self.jaccard_threshold <= 1:
            fail("--jaccard-threshold", f"must be in (0, 1], got {self.jaccard_threshold}")
        if not 0 <= self.valid_fraction < 1:
            fail("--valid-fraction", f"must be in [0, 1), got {self.valid_fraction}")
        if self.txt_documents not in ("blank-line", "file"):
            fail("--txt-documents", f"choose blank-line or file, not {self.txt_documents!r}")
        if self.shard is not None:
            index, count = self.shard
            if not 0 <= index < count:
                fail("--shard", f"I/N needs 0 <= I < N, got {index}/{count}")
            if self.tokenizer is None:
                fail("--shard", "shards must share one tokenizer: pass --tokenizer FILE "
                     "(train it first with a run on a sample of the corpus)")
        if self.tokenizer is not None and not os.path.isfile(self.tokenizer):
            fail("--tokenizer", f"{self.tokenizer}: no such file")
        if self.dedup_against and self.dedup != "minhash":
            fail("--dedup-against", f"needs --dedup minhash (the signatures it compares), not "
                 f"{self.dedup}")
        for folder in self.dedup_against:
            if not os.path.exists(os.path.join(folder, "manifest.json")):
                fail("--dedup-against", f"{folder}: no manifest.json; name folders written by "
                     "tupe-prep")
            if os.path.realpath(folder) == os.path.realpath(self.output):
                fail("--dedup-against", f"{folder} is this run's --out: its documents would all "
                     "be found there and removed; name the other corpora's folders")
        if self.dedup_against:  # this run's folder beside them, at this tupe-prep's version
            versions = {folder: cleaning_version(folder, read_manifest(folder))
                        for folder in self.dedup_against}
            check_cleaning_versions({f"{self.output} (this run)": CLEANING_VERSION, **versions},
                                    "--dedup-against")

    def shard_files(self, files: List[str]) -> List[str]:
        """The I-th of N contiguous groups of input files (so merged shards keep input order)."""
        if self.shard is None:
            return files
        index, count = self.shard
        if len(files) < count:
            raise ValueError(f"--shard: {len(files)} input file(s) cannot make {count} shards; "
                             "split the input into at least as many files as shards")
        bounds = np.linspace(0, len(files), count + 1).round().astype(int)
        return files[bounds[index]:bounds[index + 1]]
