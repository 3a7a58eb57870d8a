"""The fast attention layout (the default) against the dense reference, and what it hands SDPA."""

import pytest
import torch
import torch.nn.functional as F

import tupe_ds
from tupe_ds.model import positional

ENCODINGS = list(tupe_ds.ENCODINGS)
UNTIED_ABSOLUTE = ["tupe-a", "tupe-a-tie-cls"]


def inputs(padded: bool, b=3, n=40, vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (b, n), generator=generator)
    labels = ids.masked_fill(torch.rand(b, n, generator=generator) > 0.3, -100)
    mask = torch.ones(b, n, dtype=torch.long)
    if padded:
        mask[1, 25:] = 0
        mask[2, 7:] = 0
    return ids, mask, labels.masked_fill(mask == 0, -100)


def loss_logits_grads(model, ids, mask, labels):
    loss, logits = model(ids, mask, labels)
    loss.backward()
    return loss.detach(), logits.detach(), {name: p.grad for name, p in model.named_parameters()}


# What the device decides, by name: the CPU's choices; CUDA's untied columns, with widened heads
# unpadded and padded to 64 as CUDA's cuDNN kernels want them.
LAYOUTS = {"cpu": (False, 1), "columns": (True, 1), "columns-padded-to-64": (True, 64)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", ["padding", "no-padding", "mask-of-ones"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fast_layout_matches_dense(tiny_model, monkeypatch, encoding, batch, layout):
    columns, multiple = LAYOUTS[layout]
    monkeypatch.setattr(positional, "untied_as_columns", lambda device: columns)
    monkeypatch.setattr(positional, "fast_head_multiple", lambda device, masked: multiple)
    ids, mask, labels = inputs(padded=batch == "padding")
    passed_mask = None if batch == "no-padding" else mask
    extra = {"causal_layers": 2} if encoding == "mask-nope" else {}
    dense = tiny_model(encoding, num_layers=3, attention="dense", **extra)
    fast = tiny_model(encoding, num_layers=3, attention="fast", **extra)
    expected_loss, expected_logits, expected_grads = loss_logits_grads(dense, ids, mask, labels)
    loss, logits, grads = loss_logits_grads(fast, ids, passed_mask, labels)
    real = mask.bool()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[real], expected_logits[real], rtol=1e-5, atol=1e-5)
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        if grad is None:  # a parameter the dense path does not use
            assert grads[name] is None or not grads[name].any(), name
        else:
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def sdpa_calls(model, ids, mask, monkeypatch) -> list:
    """(q, k, v, attn_mask, is_causal) of every SDPA call of one forward + backward."""
    calls = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q, k, v, attn_mask, is_causal))
        return original(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model(ids, mask)[0].sum().backward()
    assert len(calls) == model.model_config.num_layers
    return calls


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("encoding", UNTIED_ABSOLUTE)
def test_untied_absolute_terms_reach_sdpa_without_a_mask(tiny_model, monkeypatch, encoding, padded):
    """TUPE-A's positional term (and padding) travel as wider q/k heads, never as a float mask
    (as on CUDA)."""
    monkeypatch.setattr(positional, "untied_as_columns", lambda device: True)
    ids, mask, _ = inputs(padded)
    model = tiny_model(encoding, attention="fast")
    d = model.model_config.head_size
    for q, k, v, attn_mask, _ in sdpa_calls(model, ids, mask if padded else None, monkeypatch):
        assert attn_mask is None
        widened = 2 * d + (encoding == "tupe-a") + padded  # [content, positional, [CLS], padding]
        assert q.shape[-1] == k.shape[-1] == widened and v.shape[-1] == d


@pytest.mark.parametrize("columns", [True, False], ids=["untied-as-columns", "untied-as-mask"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_no_mask_without_padding_and_none_per_sample_and_head(tiny_model, monkeypatch, encoding,
                                                              columns):
    monkeypatch.setattr(positional, "untied_as_columns", lambda device: columns)
    b, n = 3, 40
    model = tiny_model(encoding, attention="fast")
    heads = model.model_config.num_attention_heads
    encoding = model.model_config.encoding
    positional_mask = encoding.relative or (encoding.untied and not columns)
    ids, mask, _ = inputs(padded=True, b=b, n=n)
    for *_, attn_mask, is_causal in sdpa_calls(model, ids, mask, monkeypatch):
        assert attn_mask is not None or is_causal or not positional_mask
        assert attn_mask is None or attn_mask.shape != (b, heads, n, n)
    unpadded = sdpa_calls(model, ids, None, monkeypatch)
    for *_, attn_mask, is_causal in unpadded:
        if positional_mask:  # the content-free v, one for the batch
            assert attn_mask.shape == (1, heads, n, n)
        else:
            assert attn_mask is None
    if model.model_config.pos_encoding == "mask-nope":
        assert [is_causal for *_, is_causal in unpadded] == [True, False]


def test_padding_columns_mask_exactly_in_half_precision():
    """A padded key's logit drops by 1e4 whatever the dtype, and real keys' logits are unchanged."""
    padding = torch.tensor([[False, False, True]])
    scale = 1 / 8 ** 0.5
    query, key = positional.padding_columns(padding, scale)
    for dtype in (torch.float16, torch.bfloat16):
        q, k = query.to(dtype), key.to(dtype)
        assert torch.isfinite(q).all() and torch.isfinite(k).all()
        logits = (q.float() * k.float()).squeeze() * scale  # the kernels accumulate in fp32
        assert logits[:2].eq(0).all() and logits[2] < -9e3


@pytest.mark.parametrize("device, masked, multiple", [("cuda", False, 64), ("cuda", True, 8),
                                                      ("cpu", False, 1)])
def test_fast_head_multiple(device, masked, multiple):
    assert positional.fast_head_multiple(torch.device(device), masked) == multiple


@pytest.mark.parametrize("device, columns", [("cuda", True), ("cpu", False)])
def test_untied_as_columns(device, columns):
    assert positional.untied_as_columns(torch.device(device)) is columns


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="ModelConfig.attention: unknown attention 'flash'"):
        tupe_ds.ModelConfig(attention="flash")
