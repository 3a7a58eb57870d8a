"""Every positional encoding against the plain implementation of the papers' equations."""

import pytest
import torch

import tupe_ds
from reference import reference_logits

ENCODINGS = list(tupe_ds.ENCODINGS)


def batch(b=3, n=40, vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (b, n), generator=generator)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, 7:] = 0
    return ids, mask


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_matches_paper_equations(tiny_model, encoding):
    extra = {"causal_layers": 2} if encoding == "mask-nope" else {}
    model = tiny_model(encoding, num_layers=3, **extra).eval()
    ids, mask = batch()
    with torch.no_grad():
        logits = model(ids, mask)
    expected = reference_logits(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_padding_does_not_change_real_positions(tiny_model, encoding):
    model = tiny_model(encoding).eval()
    ids = torch.randint(5, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([ids, torch.zeros(2, 9, dtype=ids.dtype)], dim=1)
    mask = torch.cat([torch.ones(2, 20), torch.zeros(2, 9)], dim=1).long()
    with torch.no_grad():
        unpadded_logits = model(ids)
        padded_logits = model(padded, mask)
    torch.testing.assert_close(padded_logits[:, :20], unpadded_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("encoding", ["tupe-r", "tupe-a", "bert-a", "mask-nope", "bert-a-d"])
def test_half_precision_padded_forward_is_finite(tiny_model, encoding, dtype):
    model = tiny_model(encoding, dtype=dtype).eval()
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        loss, logits = model(ids, mask, labels)
    assert logits.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert torch.isfinite(logits).all() and torch.isfinite(loss)


def test_loss_ignores_minus_100_and_matches_cross_entropy(tiny_model):
    model = tiny_model("tupe-r").eval()
    ids, mask = batch()
    labels = ids.clone()
    labels[:, ::3] = -100
    with torch.no_grad():
        loss, logits = model(ids, mask, labels)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
