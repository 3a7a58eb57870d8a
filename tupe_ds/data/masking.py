"""Dynamic masking: which tokens a sample's loss is on, and what the model sees there; and
MaskedSamples, the endless stream of a packed dataset's samples, each masked anew in each epoch.

The random numbers of sample s in epoch e come from tupe_ds.data.counter_random at coordinates
(seed, e, s, position), so a sample is masked the same way alone (`mask_tokens`, the reference)
or in a micro-batch (`mask_batch`, what training runs), on any rank; and ELECTRA's generator
samples its replacement at a masked position from a draw at the same coordinates
(`generator_draws`), so a sample is corrupted alike in every layout.

MaskedSamples visits every packed sample once per epoch in an order drawn from (seed, epoch) and
masks each from (seed, epoch, sample): global sample g is the same whatever the number of ranks.
It reads and masks a micro-batch in whole-batch operations (`MaskedSamples.batch`, through
`mask_batch`); sample by sample (`mask_tokens`, rows padded by `collate`), the reference, gives
the same tensors.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List

import numpy as np
import torch

from tupe_ds.data import counter_random

if TYPE_CHECKING:  # an annotation only: packing.py imports megatron-core's datasets
    from tupe_ds.data.packing import PackedSentences

IGNORE_INDEX = -100  # the label of a token the loss skips (torch's cross-entropy default)
MAX_SEQ_LEN = 1 << 16  # positions fill the low 16 bits of the keys that pick the chosen tokens
SAMPLES_AT_ONCE = 1 << 20  # real_tokens' memory: a few arrays of this many int64s

Batch = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class MaskingScheme:
    """Of the `probability` share of tokens chosen, `mask` become [MASK], `random` a random
    token, the rest stay. BERT: 15% with 80/10/10; ELECTRA's generator: 15% with 85/0/15 (the
    defaults of tupe-pretrain's --mask-rate and --mask-split, which check what they are given)."""

    probability: float = 0.15
    mask: float = 0.8
    random: float = 0.1

    def __str__(self) -> str:
        return (f"{self.probability * 100:g}% of tokens masked ({self.mask * 100:g}% [MASK], "
                f"{self.random * 100:g}% random)")


BERT_MASKING = MaskingScheme()
ELECTRA_MASKING = MaskingScheme(probability=0.15, mask=0.85, random=0.0)


@dataclass(frozen=True)
class MaskingIds:
    """The ids masking writes: [MASK], and random replacements drawn from [random_low,
    random_high) (the ids after the special ones)."""

    mask: int
    random_low: int
    random_high: int


def chosen_count(candidates, probability: float):
    """round(probability x candidates), at least 1 where there is a candidate (halves round to
    even, as Python's round does)."""
    return np.minimum(candidates, np.maximum(1, np.rint(probability * np.asarray(candidates))))


def choice_keys(keys, positions) -> np.ndarray:
    """Distinct sort keys: random high bits, the position in the low 16. The chosen positions
    are the candidates with the smallest keys."""
    high = counter_random.bits(keys, positions) & ~np.uint64(MAX_SEQ_LEN - 1)
    return high | np.asarray(positions, dtype=np.uint64)


def replacements(keys, positions, ids: MaskingIds) -> np.ndarray:
    span = ids.random_high - ids.random_low
    drawn = np.floor(counter_random.uniform(keys, positions) * span).astype(np.int64)
    return ids.random_low + drawn


def mask_tokens(tokens: np.ndarray, seed: int, epoch: int, sample: int, scheme: MaskingScheme,
                ids: MaskingIds, special: np.ndarray):
    """(inputs, labels) of one sample: labels hold the original ids at chosen positions,
    IGNORE_INDEX elsewhere. Exactly round(probability * candidates) positions (at least 1) are
    chosen among the tokens not in `special`. The reference for `mask_batch`."""
    keys = [counter_random.sample_keys(seed, epoch, sample, stream) for stream in
            (counter_random.CHOICE, counter_random.ACTION, counter_random.REPLACEMENT)]
    candidates = np.flatnonzero(~np.isin(tokens, special))
    count = int(chosen_count(len(candidates), scheme.probability))
    chosen = candidates[np.argsort(choice_keys(keys[0], candidates))[:count]]
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[chosen] = tokens[chosen]
    inputs = tokens.copy()
    action = counter_random.uniform(keys[1], chosen)
    to_mask = chosen[action < scheme.mask]
    to_random = chosen[(action >= scheme.mask) & (action < scheme.mask + scheme.random)]
    inputs[to_mask] = ids.mask
    inputs[to_random] = replacements(keys[2], to_random, ids)
    return inputs, labels


def mask_batch(tokens: np.ndarray, seed: int, epochs: np.ndarray, samples: np.ndarray,
               scheme: MaskingScheme, ids: MaskingIds, is_special: np.ndarray):
    """`mask_tokens` of every row of tokens [batch, seq_len] (row i is sample samples[i] of
    epoch epochs[i]; padding must be special), in whole-batch operations: (inputs, labels).
    `is_special[id]` says whether an id is special."""
    rows, length = tokens.shape
    assert length <= MAX_SEQ_LEN
    positions = np.arange(length)
    candidate = ~is_special[tokens]
    count = chosen_count(candidate.sum(axis=1), scheme.probability).astype(np.int64)
    choice = counter_random.sample_keys(seed, epochs, samples, counter_random.CHOICE)
    keys = np.where(candidate, choice_keys(choice[:, None], positions), np.uint64(2**64 - 1))
    threshold = np.sort(keys, axis=1)[np.arange(rows), np.maximum(count - 1, 0)]
    chosen = candidate & (keys <= threshold[:, None]) & (count > 0)[:, None]
    row, column = np.nonzero(chosen)
    labels = np.where(chosen, tokens, IGNORE_INDEX)
    inputs = tokens.copy()
    action_keys = counter_random.sample_keys(seed, epochs, samples, counter_random.ACTION)
    action = counter_random.uniform(action_keys[row], column)
    to_mask = action < scheme.mask
    to_random = (action >= scheme.mask) & (action < scheme.mask + scheme.random)
    inputs[row[to_mask], column[to_mask]] = ids.mask
    replacement_keys = counter_random.sample_keys(seed, epochs, samples,
                                                  counter_random.REPLACEMENT)
    inputs[row[to_random], column[to_random]] = replacements(
        replacement_keys[row[to_random]], column[to_random], ids)
    return inputs, labels


def generator_draws(seed: int, epochs: np.ndarray, samples: np.ndarray,
                    labels: np.ndarray) -> np.ndarray:
    """float32 [rows, seq_len]: at each labelled position of labels (row i is sample samples[i] of
    epoch epochs[i]) a number in (0, 1] on the float32 grid of 2**-24 (so that it stays in (0, 1]
    on the device), from which ELECTRA's generator draws its replacement token (inverse CDF:
    ElectraForPretraining.sample); 0 elsewhere."""
    row, column = np.nonzero(labels != IGNORE_INDEX)
    keys = counter_random.sample_keys(seed, epochs, samples, counter_random.GENERATOR)
    grid = (counter_random.bits(keys[row], column) >> np.uint64(40)).astype(np.float64) + 1
    draws = np.zeros(labels.shape, dtype=np.float32)
    draws[row, column] = grid * 2.0**-24
    return draws


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
    """The endless stream over a PackedSentences dataset: global sample g is packed sample
    order_epoch[position], (epoch, position) = divmod(g, len(packed)), masked from (seed, epoch,
    sample). `vocab`: the data folder's loader.Vocabulary (not imported: loader.py imports this
    module). `vectorised=False` makes batches sample by sample (the reference); `draws` adds
    the ELECTRA generator's `generator_draws` to each batch."""

    def __init__(self, packed: "PackedSentences", vocab, scheme: MaskingScheme, seed: int,
                 vectorised: bool = True, draws: bool = False):
        if len(packed) == 0:
            raise ValueError(f"{packed.prefix}: the dataset holds no sample")
        self.packed, self.vocab, self.scheme, self.seed = packed, vocab, scheme, seed
        self.vectorised, self.draws = vectorised, draws
        self.special = np.array(vocab.special)
        self.is_special = np.zeros(vocab.size, dtype=bool)
        self.is_special[self.special] = True
        self.ids = MaskingIds(mask=vocab.mask, random_low=max(vocab.special) + 1,
                              random_high=vocab.size)

    def locate(self, global_samples: np.ndarray):
        """(epochs, samples) of global samples."""
        epochs, positions = np.divmod(np.asarray(global_samples, dtype=np.int64), len(self.packed))
        samples = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            samples[here] = counter_random.permutation(self.seed, int(epoch), len(self.packed),
                                                       positions[here])
        return epochs, samples

    def masked(self, epoch: int, sample: int) -> tuple:
        """(inputs, labels) of one sample, read and masked alone."""
        return mask_tokens(self.packed[sample], self.seed, epoch, sample, self.scheme, self.ids,
                           self.special)

    def __getitem__(self, g: int) -> tuple:
        epochs, samples = self.locate(np.array([g]))
        return self.masked(int(epochs[0]), int(samples[0]))

    def batch(self, epochs: np.ndarray, samples: np.ndarray) -> Batch:
        """Sample samples[i] of epoch epochs[i] in row i."""
        seq_len, pad = self.packed.seq_len, self.vocab.pad
        if self.vectorised:
            tokens, lengths = self.packed.rows(samples, pad)
            inputs, labels = mask_batch(tokens, self.seed, epochs, samples, self.scheme, self.ids,
                                        self.is_special)
            attention_mask = (np.arange(seq_len) < lengths[:, None]).astype(np.int64)
            batch = {"input_ids": torch.from_numpy(inputs),
                     "attention_mask": torch.from_numpy(attention_mask),
                     "labels": torch.from_numpy(labels)}
        else:
            batch = collate([self.masked(int(e), int(s)) for e, s in zip(epochs, samples)],
                            seq_len, pad)
        if self.draws:
            batch["generator_draws"] = torch.from_numpy(
                generator_draws(self.seed, epochs, samples, batch["labels"].numpy()))
        return batch

    def global_samples(self, first: int, count: int) -> Batch:
        """Global samples [first, first + count), one per row."""
        return self.batch(*self.locate(np.arange(first, first + count)))

    def real_tokens(self, first: int, count: int) -> int:
        """The tokens of global samples [first, first + count), padding not counted."""
        return summed_in_chunks(self.tokens_of, first, count)

    def tokens_of(self, global_samples: np.ndarray) -> int:
        """The tokens of these global samples, from the index alone (PackedSentences.lengths)."""
        return int(self.packed.lengths(self.locate(global_samples)[1]).sum())


def summed_in_chunks(count_of: Callable[[np.ndarray], int], first: int, count: int) -> int:
    """count_of(global samples) over [first, first + count), SAMPLES_AT_ONCE at a time."""
    return sum(count_of(np.arange(start, min(start + SAMPLES_AT_ONCE, first + count)))
               for start in range(first, first + count, SAMPLES_AT_ONCE))
