"""Real sample lengths for the GPU benchmarks: batches padded as the training loader pads them.

tupe_ds packs FULL-SENTENCES samples of up to seq tokens greedily, so most samples are shorter
than seq and padded. bench/sample_lengths.json holds the histogram of the real lengths the
loader gave on the bundled corpus (written by `python bench/padding.py --data build/sample-prep
--write-lengths bench/sample_lengths.json`); these functions draw lengths from it:

    from real_lengths import real_lengths, padding_mask     # bench/ is on sys.path
    lengths = real_lengths(128, 64, torch.Generator().manual_seed(0))
    attention_mask = padding_mask(lengths, 128)             # [64, 128], 1 = real, 0 = padding

The file is read at the first call, not at import.
"""

import functools
import json
import math
import os

import torch

LENGTHS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_lengths.json")
SHORTEST = 2  # "[CLS] [SEP]"


@functools.lru_cache(maxsize=None)
def recorded_counts() -> dict:
    """{seq: float64 tensor [seq + 1]}: counts[length] = samples of that real length."""
    with open(LENGTHS_FILE) as f:
        recorded = json.load(f)["seq_len"]
    return {int(seq): torch.tensor(entry["counts"], dtype=torch.float64)
            for seq, entry in recorded.items()}


@functools.lru_cache(maxsize=None)
def length_probabilities(seq: int) -> torch.Tensor:
    """Probabilities [seq + 1] of each real length at `seq`: the recorded histogram, or for a
    seq not recorded the nearest recorded one's (by ratio) with each length scaled by
    seq / recorded seq and rounded (a full sample stays full)."""
    counts = recorded_counts()
    nearest = min(counts, key=lambda recorded: abs(math.log(seq / recorded)))
    if nearest == seq:
        scaled = counts[seq]
    else:
        lengths = torch.arange(nearest + 1, dtype=torch.float64) * seq / nearest
        where = lengths.round().long().clamp(SHORTEST, seq)
        scaled = torch.zeros(seq + 1, dtype=torch.float64).index_add_(0, where, counts[nearest])
    return scaled / scaled.sum()


def real_lengths(seq: int, count: int, generator: torch.Generator) -> torch.LongTensor:
    """`count` real sample lengths in [2, seq], drawn independently from bench/sample_lengths.json's
    histogram for `seq` (the bundled corpus, as the training loader packs it). A `seq` the file
    does not hold takes the distribution of length / seq of the nearest recorded seq (by ratio),
    scaled to `seq`: the share of full samples is kept, and scaled up the lengths lie on a grid
    of seq / recorded steps. The lengths are on the generator's device."""
    probabilities = length_probabilities(seq).to(generator.device)
    drawn = torch.multinomial(probabilities, count, replacement=True, generator=generator)
    return drawn.clamp(SHORTEST, seq)


def padding_mask(lengths: torch.Tensor, seq: int) -> torch.LongTensor:
    """Attention mask [count, seq] of samples of these lengths: 1 = real token, 0 = padding."""
    positions = torch.arange(seq, device=lengths.device)
    return (positions < lengths[:, None]).long()
