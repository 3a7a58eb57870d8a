"""The stream of masked-LM batches: which samples each data-parallel rank sees at each step.

Optimizer step s uses the global samples [s*B, (s+1)*B) of the stream (B the global batch);
data-parallel rank r takes the r-th slice of them, in gradient-accumulation micro-batches. The
stream visits every packed sample once per epoch in an order drawn from (seed, epoch), and each
sample is masked anew from (seed, epoch, sample). So one seed gives the same global batches
whatever the number of ranks, and a run resumed at step s sees exactly what it had not seen.
"""

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterator, List

import numpy as np
import torch
from tokenizers import Tokenizer

from tupe_ds.data.masking import IGNORE_INDEX, MaskingScheme, mask_tokens
from tupe_ds.data.packing import PackedSentences

Batch = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Vocabulary:
    """The ids the data pipeline needs, read from the data folder's tokenizer.json."""

    size: int
    pad: int
    cls: int
    sep: int
    mask: int
    special: tuple  # ids never masked or drawn as random replacements

    @classmethod
    def from_data_dir(cls, data_dir: str) -> "Vocabulary":
        path = os.path.join(data_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: missing; --data must be a folder written by tupe-prep")
        tokenizer = Tokenizer.from_file(path)
        special = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        ids = {name: tokenizer.token_to_id(f"[{name.upper()}]") for name in ("pad", "cls", "sep", "mask")}
        return cls(size=tokenizer.get_vocab_size(), special=tuple(special), **ids)


def collate(samples: List[tuple], seq_len: int, pad: int) -> Batch:
    """[(inputs, labels)] -> input_ids, attention_mask, labels: [batch, seq_len], padded."""
    batch = len(samples)
    input_ids = np.full((batch, seq_len), pad, dtype=np.int64)
    labels = np.full((batch, seq_len), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((batch, seq_len), dtype=np.int64)
    for row, (inputs, targets) in enumerate(samples):
        input_ids[row, : len(inputs)] = inputs
        labels[row, : len(targets)] = targets
        attention_mask[row, : len(inputs)] = 1
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels)}


class MaskedSamples:
    """Masked sample g of the endless stream over a PackedSentences dataset."""

    def __init__(self, packed: PackedSentences, vocab: Vocabulary, scheme: MaskingScheme, seed: int):
        if len(packed) == 0:
            raise ValueError("the dataset holds no sample")
        self.packed, self.vocab, self.scheme, self.seed = packed, vocab, scheme, seed
        self.special = np.array(vocab.special)
        self.random_low = max(vocab.special) + 1

    @lru_cache(maxsize=2)
    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.packed))

    def masked(self, epoch: int, sample: int) -> tuple:
        rng = np.random.default_rng([self.seed, epoch, sample])
        return mask_tokens(self.packed[sample], rng, self.scheme, self.vocab.mask,
                           self.random_low, self.vocab.size, self.special)

    def __getitem__(self, g: int) -> tuple:
        epoch, position = divmod(g, len(self.packed))
        return self.masked(epoch, int(self.order(epoch)[position]))


class TrainBatches:
    """This rank's micro-batches, step by step; `consumed` (global samples) is the resume state."""

    def __init__(self, samples: MaskedSamples, seq_len: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp_size: int, consumed: int = 0):
        self.samples, self.seq_len = samples, seq_len
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = consumed

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def next_step(self) -> Iterator[Batch]:
        """The micro-batches of the next optimizer step, collated when read (pipeline stages that
        read no data skip the work); the step counts as consumed when this is called."""
        per_rank = self.micro_batch * self.grad_accum
        start = self.consumed + self.dp_rank * per_rank
        self.consumed += self.global_batch
        return (collate([self.samples[g] for g in range(first, first + self.micro_batch)],
                        self.seq_len, self.samples.vocab.pad)
                for first in range(start, start + per_rank, self.micro_batch))


def valid_batches(samples: MaskedSamples, seq_len: int, micro_batch: int, dp_rank: int,
                  dp_size: int, count: int) -> Iterator[Batch]:
    """The first `count` samples (one fixed masking), this rank's share, in micro-batches.

    The last micro-batch is filled up with empty rows (all padding, no label), which count for
    nothing, so that every micro-batch has the shape the pipeline engine's buffers expect.
    """
    count = min(count, len(samples.packed))
    mine = list(range(dp_rank, count, dp_size))
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    for first in range(0, len(mine), micro_batch):
        rows = [samples.masked(0, g) for g in mine[first:first + micro_batch]]
        yield collate(rows + [empty] * (micro_batch - len(rows)), seq_len, samples.vocab.pad)
