"""The batches shared by the parallel workers and the single-process references."""

import torch


def inputs(batch=2, n=24, vocab=512, seed=123):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, n), generator=generator)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, 17:] = 0
    labels = ids.masked_fill(torch.rand(batch, n, generator=generator) > 0.3, -100)
    return ids, mask, labels.masked_fill(mask == 0, -100)


def micro_batches(count=2):
    """`count` different micro-batches of `inputs`."""
    return [inputs(seed=123 + i) for i in range(count)]
