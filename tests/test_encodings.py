"""Every positional encoding against the plain implementation of the papers' equations."""

import pytest
import torch

import tupe_ds
from reference import reference_logits
from tupe_ds.model.layers import (at_labelled, labelled_positions, vocabulary_parallel_loss,
                                  whole_vocabulary_loss)

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


def test_whole_vocabulary_loss_is_megatron_cores_at_tp_1():
    """At tensor-parallel size 1 the loss is torch's cross-entropy: the same sum and gradient as
    megatron-core's vocab-parallel one, which tp > 1 runs (tests/test_tensor_parallel.py)."""
    generator = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(7, 3, 512, generator=generator)).requires_grad_()
    labels = torch.randint(0, 512, (7, 3), generator=generator).masked_fill(
        torch.rand(7, 3, generator=generator) < 0.5, -100)
    tupe_ds.build_model("tiny")  # megatron-core's parallel state at tp 1
    sums = [loss(logits, labels) for loss in (whole_vocabulary_loss, vocabulary_parallel_loss)]
    grads = [torch.autograd.grad(total, logits)[0] for total in sums]
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("encoding", ["tupe-r", "bert-a"])
def test_head_on_labelled_tokens_matches_full_head(tiny_model, encoding):
    """labelled= (what training passes): the same loss, logits and gradients as the full head."""
    ids, mask = batch()
    chosen = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.2
    labels = ids.masked_fill(~chosen | (mask == 0), -100)
    full, only_labelled = tiny_model(encoding), tiny_model(encoding)
    loss, logits = full(ids, mask, labels)
    loss.backward()
    positions = labelled_positions(labels)
    labelled_loss, labelled_logits = only_labelled(ids, mask, labels, positions)
    labelled_loss.backward()
    seq_major = logits.transpose(0, 1).reshape(-1, logits.shape[-1])  # the order of `positions`
    assert labelled_logits.shape == (int((labels != -100).sum()), 512)
    torch.testing.assert_close(labelled_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(labelled_logits, seq_major[positions], rtol=1e-5, atol=1e-5)
    assert (at_labelled(labels, positions) != -100).all()
    for (name, p), q in zip(full.named_parameters(), only_labelled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
