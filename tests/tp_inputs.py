"""The batch shared by the tensor-parallel worker and the single-process reference."""

import torch


def inputs(batch=2, n=24, vocab=512):
    generator = torch.Generator().manual_seed(123)
    ids = torch.randint(5, vocab, (batch, n), generator=generator)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, 17:] = 0
    labels = ids.masked_fill(torch.rand(batch, n, generator=generator) > 0.3, -100)
    return ids, mask, labels.masked_fill(mask == 0, -100)
