"""The stream of masked-LM batches: which samples each data-parallel rank sees at each step.

Optimizer step s uses the global samples [s*B, (s+1)*B) of the stream (B the global batch);
data-parallel rank r takes the r-th slice of them, in gradient-accumulation micro-batches. The
stream visits every packed sample once per epoch in an order drawn from (seed, epoch), and each
sample is masked anew from (seed, epoch, sample). So one seed gives the same global batches
whatever the number of ranks, and a run resumed at step s sees exactly what it had not seen.

For ELECTRA a batch also carries `generator_draws`, the numbers from which the generator
samples its replacements (masking.generator_draws), so a sample is corrupted alike in any layout.

A micro-batch is read and masked in whole-batch operations (`masking.MaskedSamples.batch`;
sample by sample, the reference, gives the same tensors), and a background thread makes the next
steps' batches while the current one trains (`TrainBatches(prefetch=...)`).
"""

import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from tupe_ds.data.masking import IGNORE_INDEX, Batch, MaskedSamples
from tupe_ds.data.prefetch import Prefetched


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
        with open(path, encoding="utf-8") as f:  # an OSError, where from_file's is no OSError
            tokenizer = Tokenizer.from_str(f.read())
        special = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        ids = {name: tokenizer.token_to_id(f"[{name.upper()}]") for name in ("pad", "cls", "sep", "mask")}
        return cls(size=tokenizer.get_vocab_size(), special=tuple(special), **ids)


class TrainBatches:
    """This rank's micro-batches, step by step; `consumed` (global samples) is the resume state.
    A step's global batch is micro_batch x grad_accum x dp_size, or `ramp(consumed)` (a batch
    ramp: train/batch_ramp.py) for the step that starts at sample `consumed`. With prefetch > 0
    a thread makes up to that many steps ahead (pinned when `pin`)."""

    def __init__(self, samples: MaskedSamples, micro_batch: int, grad_accum: int, dp_rank: int,
                 dp_size: int, consumed: int = 0, prefetch: int = 0, pin: bool = False,
                 ramp: Optional[Callable[[int], int]] = None, tokens_seen: Optional[int] = None):
        self.samples = samples
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.ramp = ramp
        self.consumed = consumed
        # the real tokens of the global samples before `counted` (None: counted from 0 when asked)
        self.counted, self.tokens = (0, 0) if tokens_seen is None else (consumed, tokens_seen)
        self.ahead = Prefetched(self._steps(consumed), prefetch, pin) if prefetch else None

    def batch_at(self, consumed: int) -> int:
        """The global batch of the step that starts at global sample `consumed`."""
        if self.ramp is not None:
            return self.ramp(consumed)
        return self.micro_batch * self.grad_accum * self.dp_size

    @property
    def global_batch(self) -> int:
        """The next step's global batch."""
        return self.batch_at(self.consumed)

    def step(self, consumed: int) -> Iterator[Batch]:
        """The micro-batches of the step that starts at global sample `consumed`, made when read
        (pipeline stages that read no data skip the work)."""
        per_rank = self.batch_at(consumed) // self.dp_size
        start = consumed + self.dp_rank * per_rank
        return (self.samples.global_samples(first, self.micro_batch)
                for first in range(start, start + per_rank, self.micro_batch))

    def _steps(self, consumed: int):
        while True:
            yield list(self.step(consumed))
            consumed += self.batch_at(consumed)

    def next_step(self) -> Iterator[Batch]:
        """The micro-batches of the next optimizer step; the step counts as consumed when this
        is called."""
        consumed = self.consumed
        self.consumed += self.batch_at(consumed)
        return next(self.ahead) if self.ahead else self.step(consumed)

    def tokens_seen(self) -> int:
        """The real tokens (padding not counted) of every global sample consumed so far, by
        every rank: counted from the index since the last call."""
        self.tokens += self.samples.real_tokens(self.counted, self.consumed - self.counted)
        self.counted = self.consumed
        return self.tokens

    def close(self) -> None:
        if self.ahead:
            self.ahead.close()


def with_empty_rows(batch: Batch, rows: int, pad: int) -> Batch:
    """`batch` grown to `rows` rows with empty ones (all padding, no label), which count for
    nothing: every micro-batch then has the shape the pipeline engine's buffers expect."""
    missing = rows - len(batch["input_ids"])
    if missing == 0:
        return batch
    fill = {"input_ids": pad, "attention_mask": 0, "labels": IGNORE_INDEX, "generator_draws": 0}
    return {key: torch.cat([value, value.new_full((missing, value.shape[1]), fill[key])])
            for key, value in batch.items()}


def valid_batches(samples: MaskedSamples, micro_batch: int, dp_rank: int, dp_size: int,
                  count: int) -> Iterator[Batch]:
    """The first `count` samples (masked as in epoch 0), whatever the layout: this rank's share
    (samples dp_rank, dp_rank + dp_size, ...) in micro-batches. Every rank makes the same number
    of micro-batches, the last ones filled up with empty rows (ZeRO-3 gathers parameters in
    every forward, with every rank)."""
    count = min(count, len(samples.packed))
    mine = np.arange(dp_rank, count, dp_size)
    for first in range(0, -(-count // dp_size), micro_batch):
        rows = mine[first:first + micro_batch]
        yield with_empty_rows(samples.batch(np.zeros_like(rows), rows), micro_batch,
                              samples.vocab.pad)
