"""GLUE tasks as the TUPE paper fine-tunes them, read from local files and tokenized.

Files: GLUE's own TSV layout (`.tsv`: CoLA without a header, the others with theirs), or `.csv`
with a header / `.jsonl` with one object per line using the same column names.
"""

import csv
import itertools
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from tokenizers import Tokenizer
from torch.nn.utils.rnn import pad_sequence
from tupe_ds.tools.errors import TaskDataError

csv.field_size_limit(2**31 - 1)


@dataclass(frozen=True)
class Task:
    name: str
    text_columns: Tuple[str, ...]  # one sentence, or a pair
    label_column: str
    labels: Optional[Tuple[str, ...]]  # None: regression (a number)
    metrics: Tuple[str, ...]  # the first is the one the paper reports
    epochs: int  # the paper: 5 for the high-resource tasks, else 10
    headerless: Optional[Tuple[str, ...]] = None  # column names of a TSV without a header (CoLA)
    glue_folder: str = ""  # the task's folder in GLUE's download
    glue_dev: Tuple[Tuple[str, str], ...] = (("dev", "dev.tsv"),)  # (set name, file) in it

    @property
    def num_outputs(self) -> int:
        return 1 if self.labels is None else len(self.labels)


TASKS = {task.name: task for task in [
    Task("cola", ("sentence",), "label", ("0", "1"), ("matthews", "accuracy"), 10,
         headerless=("source", "label", "original_label", "sentence"), glue_folder="CoLA"),
    Task("sst2", ("sentence",), "label", ("0", "1"), ("accuracy",), 10, glue_folder="SST-2"),
    Task("mrpc", ("#1 String", "#2 String"), "Quality", ("0", "1"), ("accuracy", "f1"), 10,
         glue_folder="MRPC"),
    Task("stsb", ("sentence1", "sentence2"), "score", None, ("pearson", "spearman"), 10,
         glue_folder="STS-B"),
    Task("qqp", ("question1", "question2"), "is_duplicate", ("0", "1"), ("accuracy", "f1"), 5,
         glue_folder="QQP"),
    Task("mnli", ("sentence1", "sentence2"), "gold_label",
         ("contradiction", "entailment", "neutral"), ("accuracy",), 5, glue_folder="MNLI",
         glue_dev=(("m", "dev_matched.tsv"), ("mm", "dev_mismatched.tsv"))),
    Task("qnli", ("question", "sentence"), "label", ("entailment", "not_entailment"),
         ("accuracy",), 5, glue_folder="QNLI"),
    Task("rte", ("sentence1", "sentence2"), "label", ("entailment", "not_entailment"),
         ("accuracy",), 10, glue_folder="RTE"),
]}


Example = Tuple[Tuple[str, ...], Union[int, float]]  # (texts, label index or score)


def glue_files(directory: str, task: Task) -> tuple:
    """(train file, {dev set name: file}) of `task` in a folder laid out as GLUE's download."""
    folder = os.path.join(directory, task.glue_folder)
    return (os.path.join(folder, "train.tsv"),
            {name: os.path.join(folder, file) for name, file in task.glue_dev})


def check_glue_task(directory: str, task: Task) -> None:
    """The task's files are there and their first rows read (a quick look, not every row)."""
    train, dev = glue_files(directory, task)
    for path in (train, *dev.values()):
        read_examples(path, task, limit=10)


def read_examples(path: str, task: Task, limit: Optional[int] = None) -> List[Example]:
    """(texts, label) of every row (of the first `limit` rows); errors name the file, the line and
    what to change."""
    if not os.path.exists(path):
        raise TaskDataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TaskDataError(f"{path}: a folder; give the task's file in it ("
                            f"{os.path.join(path, 'train.tsv')} to --train, "
                            f"{os.path.join(path, 'dev.tsv')} to --valid)")
    rows = list(itertools.islice(_rows(path, task), limit))
    if not rows:
        raise TaskDataError(f"{path}: no examples")
    examples = []
    for line, row in rows:
        missing = [c for c in (*task.text_columns, task.label_column) if c not in row]
        if missing:
            raise TaskDataError(
                f"{path}:{line}: no column {', '.join(map(repr, missing))}; task {task.name} reads "
                f"{', '.join(map(repr, (*task.text_columns, task.label_column)))}, the file has "
                f"{', '.join(map(repr, row))}")
        value = str(row[task.label_column]).strip()
        if task.labels is None:
            try:
                label = float(value)
            except ValueError:
                raise TaskDataError(f"{path}:{line}: {task.label_column} {value!r} is not a number "
                                    f"(task {task.name} is a regression)") from None
        elif value in task.labels:
            label = task.labels.index(value)
        else:
            raise TaskDataError(f"{path}:{line}: {task.label_column} {value!r} is not one of "
                                f"{', '.join(task.labels)} (task {task.name})")
        examples.append((tuple(str(row[c]) for c in task.text_columns), label))
    return examples


def _rows(path: str, task: Task):
    """(line number, {column: value}) of each example."""
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".jsonl"):
            for number, text in enumerate(f, 1):
                if text.strip():
                    try:
                        yield number, json.loads(text)
                    except json.JSONDecodeError as error:
                        raise TaskDataError(f"{path}:{number}: invalid JSON: {error.msg}") from None
            return
        tsv = not path.endswith(".csv")
        reader = csv.reader(f, delimiter="\t" if tsv else ",",
                            quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
        header = list(task.headerless) if tsv and task.headerless else next(reader, [])
        for number, values in enumerate(reader, 1 if tsv and task.headerless else 2):
            if values:
                yield number, dict(zip(header, values))


class ExampleTokenizer:
    """'[CLS] a [SEP]' or '[CLS] a [SEP] b [SEP]' ids, the longer text truncated first."""

    def __init__(self, path: str, model_vocabulary: int, max_length: int):
        self.tokenizer = Tokenizer.from_file(path)
        size = self.tokenizer.get_vocab_size()
        if size > model_vocabulary:
            raise TaskDataError(f"{path}: {size} tokens, more than the model's vocabulary of "
                                f"{model_vocabulary}: not the tokenizer this model was trained "
                                "with")
        ids = {t: self.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
        if None in ids.values():
            raise TaskDataError(f"{path}: no {', '.join(t for t, i in ids.items() if i is None)} "
                                "token: not a tokenizer written by tupe-prep")
        self.cls, self.sep, self.pad = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]
        self.max_length = max_length

    def __call__(self, examples) -> list:
        columns = list(zip(*(texts for texts, _ in examples)))
        encoded = [[e.ids for e in self.tokenizer.encode_batch(list(c), add_special_tokens=False)]
                   for c in columns]
        budget = self.max_length - 1 - len(columns)  # [CLS] and a [SEP] per text
        result = []
        for parts in zip(*encoded):
            parts = [list(p) for p in parts]
            while sum(map(len, parts)) > budget:
                max(parts, key=len).pop()
            ids = [self.cls]
            for part in parts:
                ids += part + [self.sep]
            result.append(ids)
        return result

    def batch(self, sequences: list) -> tuple:
        ids = pad_sequence([torch.tensor(s, dtype=torch.long) for s in sequences],
                           batch_first=True, padding_value=self.pad)
        return ids, (ids != self.pad).long()
