"""Stage 0, reading: documents out of .txt, .jsonl[.gz], .parquet files and saved HF datasets.

Everything streams: a file is never loaded whole, so inputs larger than memory are fine.
"""

import gzip
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, List


class InputError(Exception):
    """Bad input that stops the run; the message names the file (and line)."""


@dataclass
class ReadStats:
    bytes_in: int = 0
    invalid_utf8_lines: int = 0
    bad_lines_skipped: int = 0
    empty_files: List[str] = field(default_factory=list)
    invalid_utf8_examples: List[str] = field(default_factory=list)


def is_hf_dataset(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name))
               for name in ("dataset_info.json", "dataset_dict.json"))


def expand_inputs(paths: List[str]) -> List[str]:
    """Files named, files inside folders named (sorted), saved HF datasets as they are."""
    files = []
    for path in paths:
        if not os.path.exists(path):
            raise InputError(f"{path}: no such file or directory")
        if os.path.isdir(path) and not is_hf_dataset(path):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(path)
                for name in names
                if name.endswith((".txt", ".jsonl", ".jsonl.gz", ".parquet", ".txt.gz"))
            )
            if not found:
                raise InputError(f"{path}: folder holds no .txt, .jsonl[.gz] or .parquet file")
            files.extend(found)
        else:
            files.append(path)
    return files


class Reader:
    """Iterates the texts of the documents of input files, counting what it had to repair or
    skip."""

    def __init__(self, text_key: str = "text", txt_documents: str = "blank-line",
                 skip_bad_lines: bool = False):
        self.text_key = text_key
        self.txt_documents = txt_documents
        self.skip_bad_lines = skip_bad_lines
        self.stats = ReadStats()

    def documents(self, paths: List[str]) -> Iterator[str]:
        for path in paths:
            empty = True
            for text in self._read(path):
                empty = False
                yield text
            if empty:
                self.stats.empty_files.append(path)

    def _read(self, path: str) -> Iterator[str]:
        if is_hf_dataset(path):
            return self._hf_dataset(path)
        name = path[:-3] if path.endswith(".gz") else path
        if name.endswith((".jsonl", ".json")):
            return self._jsonl(path)
        if name.endswith(".parquet"):
            return self._parquet(path)
        if name.endswith(".txt"):
            return self._txt(path)
        raise InputError(f"{path}: unknown input type; use .txt, .jsonl[.gz], .parquet or a "
                         "folder saved by datasets.save_to_disk")

    def _lines(self, path: str) -> Iterator[tuple]:
        """(line number, decoded line) with invalid UTF-8 replaced and counted."""
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    self.stats.bytes_in += len(raw)
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        line = raw.decode("utf-8", errors="replace")
                        self.stats.invalid_utf8_lines += 1
                        if len(self.stats.invalid_utf8_examples) < 5:
                            self.stats.invalid_utf8_examples.append(f"{path}:{number}")
                    yield number, line
        except (EOFError, gzip.BadGzipFile) as error:
            raise InputError(f"{path}: truncated or corrupt gzip file ({error})") from None

    def _txt(self, path: str) -> Iterator[str]:
        lines = (line for _, line in self._lines(path))
        if self.txt_documents == "file":
            text = "".join(lines)
            if text.strip():
                yield text
            return
        for blank, paragraph in itertools.groupby(lines, key=lambda line: not line.strip()):
            if not blank:
                yield "".join(paragraph)

    def _bad(self, where: str, message: str) -> None:
        if not self.skip_bad_lines:
            raise InputError(f"{where}: {message} (use --skip-bad-lines to skip such lines)")
        self.stats.bad_lines_skipped += 1

    def _jsonl(self, path: str) -> Iterator[str]:
        for number, line in self._lines(path):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                self._bad(where, f"malformed JSON ({error.msg} at column {error.colno})")
                continue
            text = record.get(self.text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                self._bad(where, f"no string field {self.text_key!r} (set --text-key)")
                continue
            yield text

    def _records(self, path: str, batches) -> Iterator[str]:
        row = 0
        for batch in batches:
            if self.text_key not in batch:
                raise InputError(f"{path}: no column {self.text_key!r} (set --text-key)")
            for text in batch[self.text_key]:
                row += 1
                if not isinstance(text, str):
                    self._bad(f"{path}:row {row}", f"{self.text_key!r} is not a string")
                    continue
                self.stats.bytes_in += len(text.encode("utf-8"))
                yield text

    def _parquet(self, path: str) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as error:  # pyarrow raises several types for a bad file
            raise InputError(f"{path}: not a readable parquet file ({error})") from None
        if self.text_key not in parquet.schema_arrow.names:
            raise InputError(f"{path}: no column {self.text_key!r} (set --text-key)")
        batches = (b.to_pydict() for b in parquet.iter_batches(columns=[self.text_key]))
        return self._records(path, batches)

    def _hf_dataset(self, path: str) -> Iterator[str]:
        import datasets

        dataset = datasets.load_from_disk(path)
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset:
                raise InputError(f"{path}: a DatasetDict without a 'train' split")
            dataset = dataset["train"]
        return self._records(path, dataset.iter(batch_size=1000))
