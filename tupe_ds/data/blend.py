"""Several prepared corpora as one stream: the weighted blend of `--data 0.7 wiki 0.3 books`.

Global sample g of the blend is sample k of source i's own stream (a MaskedSamples: its order
in each epoch and its masking, as if it were trained alone; each source packed on its own, so
no sample crosses sources). i and k are computed from g alone, by the blend's schedule
(blend_schedule.py); the sources and their weights come from --data (sources.py).
"""

from typing import List, Sequence

import numpy as np
import torch

from tupe_ds.data.blend_schedule import PERIOD, Schedule
from tupe_ds.data.masking import Batch, MaskedSamples, summed_in_chunks
from tupe_ds.data.sources import Source


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

    def real_tokens(self, first: int, count: int) -> int:
        """The tokens of global samples [first, first + count), padding not counted."""
        return summed_in_chunks(self.tokens_of, first, count)

    def tokens_of(self, global_samples: np.ndarray) -> int:
        which, own = self.schedule.locate(global_samples)
        return sum(samples.tokens_of(own[which == source])
                   for source, samples in enumerate(self.sources))

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
