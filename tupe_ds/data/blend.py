"""Several prepared corpora as one stream: the weighted blend of `--data 0.7 wiki 0.3 books`.

Global sample g of the blend is sample k of source i's own stream (a MaskedSamples: its order
in each epoch and its masking, as if it were trained alone; each source packed on its own, so
no sample crosses sources). i and k come from a schedule of one period of PERIOD samples:
the weights' shares as whole numbers W_i of samples per period (largest remainders), and
Megatron's rule for the source of the next sample, the one furthest below its share so far
(`build_blending_indices` in megatron-core's helpers, which runs it over every sample of
training and keeps an index that long). One period is enough here: after PERIOD samples every
source has had exactly its W_i, and the rule starts over. So the blend is a function of g like
the single stream (the same samples for any layout, resumable at any step, each source running
through its epochs at its own pace), its memory does not grow with the corpus or the run, and
over any window of samples a source's count is within 2 of window x W_i / PERIOD (tested).
"""

import os
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from tupe_ds.data.loader import Batch, MaskedSamples

PERIOD = 10000  # the weights' resolution: shares are kept to 1e-4


@dataclass(frozen=True)
class Source:
    """A prepared folder of the blend, its weight (as given), the name its metrics carry and
    the folder of its sample indexes."""

    folder: str
    weight: float
    name: str
    index_cache: str = ""


def parse_sources(values: Sequence[str]) -> List[Source]:
    """`--data FOLDER` or `--data W1 FOLDER1 W2 FOLDER2 ...` (Megatron's --data-path form; the
    weights need not sum to 1). Raises ValueError naming what is wrong."""
    values = list(values)
    if len(values) == 1:
        return [Source(values[0], 1.0, os.path.basename(os.path.normpath(values[0])))]
    if len(values) % 2:
        raise ValueError(f"--data {' '.join(values)}: one folder, or pairs of a weight and a "
                         "folder (--data 0.7 wiki 0.3 books)")
    pairs = []
    for weight, folder in zip(values[::2], values[1::2]):
        try:
            number = float(weight)
        except ValueError:
            raise ValueError(f"--data: {weight!r} before {folder} is not a weight; write "
                             "pairs of a weight and a folder (--data 0.7 wiki 0.3 books)") from None
        if not np.isfinite(number) or number < 0:
            raise ValueError(f"--data: the weight of {folder} is {weight}; weights are numbers "
                             "of 0 or more")
        pairs.append((folder, number))
    if sum(weight for _, weight in pairs) <= 0:
        raise ValueError("--data: every weight is 0; give a source a positive weight")
    folders = [os.path.normpath(folder) for folder, _ in pairs]
    if len(set(folders)) < len(folders):
        raise ValueError(f"--data: a folder is named twice ({' '.join(folders)}); give each "
                         "source once, with its whole weight")
    names = [os.path.basename(folder) for folder in folders]  # the names are the metrics'
    # tags, so repeated ones are numbered by place
    return [Source(folder, weight, name if names.count(name) == 1 else f"{name}-{i + 1}")
            for i, ((folder, weight), name) in enumerate(zip(pairs, names))]


def shares(sources: Sequence[Source]) -> np.ndarray:
    weights = np.array([source.weight for source in sources], dtype=np.float64)
    return weights / weights.sum()


class Schedule:
    """Which source each global sample comes from, and which of that source's samples it is."""

    def __init__(self, weights: Sequence[float]):
        self.per_period = whole_shares(weights)
        self.source = np.empty(PERIOD, dtype=np.int64)
        self.rank = np.empty(PERIOD, dtype=np.int64)  # that source's samples before it
        counts = np.zeros(len(self.per_period), dtype=np.int64)
        never = np.iinfo(np.int64).min  # a source of weight 0 is never behind
        for n in range(PERIOD):
            behind = np.where(self.per_period > 0,
                              self.per_period * max(n, 1) - PERIOD * counts, never)
            source = int(np.argmax(behind))
            self.source[n], self.rank[n] = source, counts[source]
            counts[source] += 1
        assert np.array_equal(counts, self.per_period)

    def locate(self, global_samples: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(source, the source's own global sample) of each global sample of the blend."""
        period, offset = np.divmod(np.asarray(global_samples, dtype=np.int64), PERIOD)
        source = self.source[offset]
        return source, period * self.per_period[source] + self.rank[offset]

    def counts(self, first: int, count: int) -> np.ndarray:
        """How many of the global samples [first, first + count) each source gives."""
        source, _ = self.locate(np.arange(first, first + count))
        return np.bincount(source, minlength=len(self.per_period))


def whole_shares(weights: Sequence[float]) -> np.ndarray:
    """The weights as whole numbers of samples per PERIOD, summing to PERIOD: each share's floor,
    then one more for the largest remainders (the first source first among equal ones)."""
    exact = np.asarray(weights, dtype=np.float64) / np.sum(weights) * PERIOD
    whole = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - whole), kind="stable")
    whole[order[:PERIOD - whole.sum()]] += 1
    return whole


class BlendedSamples:
    """The blend's stream, read as a MaskedSamples is: `global_samples(first, count)`."""

    def __init__(self, sources: List[MaskedSamples], weights: Sequence[float]):
        self.sources = sources
        self.schedule = Schedule(weights)

    def global_samples(self, first: int, count: int) -> Batch:
        """Global samples [first, first + count), one per row, each made by its source."""
        which, own = self.schedule.locate(np.arange(first, first + count))
        batch = {}
        for source in np.unique(which):
            rows = np.flatnonzero(which == source)
            samples = self.sources[source]
            part = samples.batch(*samples.locate(own[rows]))
            for key, value in part.items():
                if key not in batch:
                    batch[key] = value.new_empty((count, *value.shape[1:]))
                batch[key][torch.from_numpy(rows)] = value
        return batch

    def shares(self, sources: Sequence[Source], first: int, count: int) -> dict:
        """train/share/NAME: the share of the global samples [first, first + count) that each
        source gave."""
        counts = self.schedule.counts(first, count)
        return {f"train/share/{source.name}": n / count for source, n in zip(sources, counts)}

    def description(self, sources: Sequence[Source]) -> str:
        """'1234 train samples', or for a blend each source's with its share of the stream:
        'train samples: wiki 1234 (70%), books 300 (30%)'."""
        if len(sources) == 1:
            return f"{len(self.sources[0].packed)} train samples"
        return "train samples: " + ", ".join(
            f"{source.name} {len(samples.packed)} ({100 * count / PERIOD:.4g}%)"
            for source, samples, count in zip(sources, self.sources, self.schedule.per_period))
