"""The fast attention layouts (the default and every selectable candidate) against the dense
reference, in fp32 and in half precision, and what they hand SDPA."""

import pytest
import torch
import torch.nn.functional as F

import tupe_ds
from conftest import perturb
from tupe_ds.model import kernel_layout

ENCODINGS = list(tupe_ds.ENCODINGS)
UNTIED_ABSOLUTE = ["tupe-a", "tupe-a-tie-cls"]
KEY_PADDING = ["auto", "mask", "column", "unpadded"]


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


# The device's choices, by name: the CPU's (TUPE-A's term as a mask, heads not padded); CUDA's
# (the term as q/k columns, widened heads padded to a multiple of 8); the columns unpadded.
LAYOUTS = {"cpu": {}, "cuda": {"untied_as_columns": True, "head_multiple": 8},
           "columns": {"untied_as_columns": True, "head_multiple": 1}}
CASES = [(batch, layout, "auto") for batch in ("no-padding", "mask-of-ones") for layout in LAYOUTS]
CASES += [("padding", layout, padding) for layout in LAYOUTS for padding in KEY_PADDING]


@pytest.fixture(scope="module")
def dense_reference():
    """(encoding, batch) -> the dense layout's loss, logits and gradients, computed once."""
    cache = {}

    def compute(encoding, batch):
        if (encoding, batch) not in cache:
            model = tiny(encoding, attention="dense")
            ids, mask, labels = inputs(padded=batch == "padding")
            cache[encoding, batch] = loss_logits_grads(model, ids, mask, labels)
        return cache[encoding, batch]

    return compute


def tiny(encoding, **overrides):
    torch.manual_seed(0)
    extra = {"causal_layers": 2} if encoding == "mask-nope" else {}
    return perturb(tupe_ds.build_model("tiny", pos_encoding=encoding, num_layers=3,
                                       hidden_dropout=0.0, attention_dropout=0.0,
                                       **extra, **overrides))


@pytest.mark.parametrize("batch, layout, key_padding", CASES)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fast_layout_matches_dense(dense_reference, encoding, batch, layout, key_padding):
    ids, mask, labels = inputs(padded=batch == "padding")
    expected_loss, expected_logits, expected_grads = dense_reference(encoding, batch)
    fast = tiny(encoding, key_padding=key_padding, **LAYOUTS[layout])
    loss, logits, grads = loss_logits_grads(fast, ids, None if batch == "no-padding" else mask,
                                            labels)
    real = mask.bool()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[real], expected_logits[real], rtol=1e-5, atol=1e-5)
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        if grad is None:  # a parameter the dense path does not use
            assert grads[name] is None or not grads[name].any(), name
        else:
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


# Relative error (Frobenius norm) against the fp32 dense reference that every layout must stay
# within, in that dtype, at BERT's head size 64 (TUPE's scale 1/sqrt(128)). Unit roundoff:
# bf16 2^-9, fp16 2^-12; measured on this test's model (2 layers, n = 40): the dense reference
# itself is off by about 1% (logits) and 2% (gradients) in bf16, 0.13% and 0.2-1.3% in fp16;
# the fast layouts by the same, at most 3.6% on a TUPE-A gradient in bf16 (its positional q/k
# columns are rounded to bf16 before the product, where the dense mask is summed in fp32).
HALF_TOLERANCE = {"bf16": {"logits": 0.03, "grads": 0.06},
                  "fp16": {"logits": 0.005, "grads": 0.03}}
HALF_LAYOUTS = {"dense": {"attention": "dense"}, "auto": {}, **LAYOUTS,
                **{f"cuda-{padding}": {**LAYOUTS["cuda"], "key_padding": padding}
                   for padding in KEY_PADDING[1:]}}


def relative_errors(model, ids, mask, labels, reference) -> dict:
    loss, logits = model(ids, mask, labels)
    loss.backward()
    expected_logits, expected_grads = reference
    real = mask.bool()
    errors = {"logits": ((logits.float() - expected_logits)[real].norm()
                         / expected_logits[real].norm()).item()}
    for name, p in model.named_parameters():
        expected = expected_grads[name]
        if expected is not None and expected.norm() > 0:
            errors[name] = ((p.grad.float() - expected).norm() / expected.norm()).item()
    return errors


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_half_precision_layouts_match_fp32(encoding, dtype):
    """Every layout, padded, in bf16 and fp16 at the real head size: logits and every gradient
    within the dtype's tolerance of the fp32 reference (the dense layout is held to it too)."""
    def build(dtype, **overrides):
        torch.manual_seed(0)
        extra = {"causal_layers": 1} if encoding == "mask-nope" else {}
        return tupe_ds.build_model("tiny", pos_encoding=encoding, hidden_size=128,
                                   num_attention_heads=2, ffn_hidden_size=256, dtype=dtype,
                                   hidden_dropout=0.0, attention_dropout=0.0, **extra, **overrides)

    ids, mask, labels = inputs(padded=True)
    reference_model = perturb(build("fp32", attention="dense"))
    loss, logits = reference_model(ids, mask, labels)
    loss.backward()
    reference = (logits, {name: p.grad for name, p in reference_model.named_parameters()})
    tolerance = HALF_TOLERANCE[dtype]
    for layout, overrides in HALF_LAYOUTS.items():
        model = build(dtype, **overrides)
        model.load_state_dict(reference_model.state_dict())
        for name, error in relative_errors(model, ids, mask, labels, reference).items():
            limit = tolerance["logits" if name == "logits" else "grads"]
            assert error <= limit, f"{layout}: {name} off by {error:.4f} > {limit} in {dtype}"


def non_finite_layouts(encoding, monkeypatch) -> list:
    """The half-precision layouts that hand SDPA a mask with -inf, or whose logits or gradients
    are not all finite, for a batch with a row of padding only (every key masked), in fp16.
    (torch's SDPA returns zeros for a row of -inf; a kernel or an eager softmax gives NaN.)"""
    ids, mask, labels = inputs(padded=True)
    mask[1] = 0
    labels[1] = -100
    masks = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, *args, **kwargs):
        masks.append(attn_mask)
        return original(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    found = []
    for layout, overrides in HALF_LAYOUTS.items():
        torch.manual_seed(0)
        extra = {"causal_layers": 1} if encoding == "mask-nope" else {}
        model = tupe_ds.build_model("tiny", pos_encoding=encoding, num_layers=2, dtype="fp16",
                                    hidden_dropout=0.0, attention_dropout=0.0, **extra,
                                    **overrides)
        masks.clear()
        loss, logits = model(ids, mask, labels)
        loss.backward()
        tensors = [logits, *(m for m in masks if m is not None),
                   *(p.grad for p in model.parameters() if p.grad is not None)]
        if not all(t.isfinite().all() for t in tensors):
            found.append(layout)
    return found


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_row_of_padding_only_stays_finite_in_fp16(encoding, monkeypatch):
    assert non_finite_layouts(encoding, monkeypatch) == []


def test_unclamped_masks_are_not_finite(monkeypatch):
    """The check above can fail: masks cast to fp16 without the clamp (fp32's minimum and the
    causal -inf become -inf)."""
    monkeypatch.setattr(kernel_layout, "additive", lambda logits, dtype: logits.to(dtype))
    assert "dense" in non_finite_layouts("mask-nope", monkeypatch)  # the causal -inf
    assert "dense" in non_finite_layouts("tupe-r", monkeypatch)  # fp32's minimum


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
    """TUPE-A's positional term (and padding) travel as wider q/k heads, never as a float mask:
    2d + 1 columns with the [CLS] reset (2d without), + 1 for padding, padded to a multiple of 8
    on CUDA (here asked for: 2 * 16 + 1 -> 40)."""
    ids, mask, _ = inputs(padded)
    for multiple in (1, 8):
        model = tiny_model(encoding, untied_as_columns=True, head_multiple=multiple)
        d = model.model_config.head_size
        for q, k, v, attn_mask, _ in sdpa_calls(model, ids, mask if padded else None, monkeypatch):
            assert attn_mask is None
            widened = 2 * d + (encoding == "tupe-a") + padded  # [content, positional, CLS, pad]
            assert q.shape[-1] == k.shape[-1] == widened + (-widened % multiple)
            assert v.shape[-1] == d


@pytest.mark.parametrize("columns", [True, False], ids=["untied-as-columns", "untied-as-mask"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_no_mask_without_padding_and_none_per_sample_and_head(tiny_model, monkeypatch, encoding,
                                                              columns):
    b, n = 3, 40
    model = tiny_model(encoding, untied_as_columns=columns)
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


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_unpadded_layout_hands_sdpa_only_the_real_tokens(tiny_model, monkeypatch, encoding):
    """key_padding="unpadded": jagged nested q/k/v holding the real tokens, no mask; encodings
    with a positional mask keep it (and padding as a column); mask-nope's causal layer keeps a
    dense causal mask (nested tensors take no is_causal)."""
    model = tiny_model(encoding, key_padding="unpadded", untied_as_columns=True)
    ids, mask, _ = inputs(padded=True)
    enc = model.model_config.encoding
    for layer, (q, k, v, attn_mask, _) in enumerate(sdpa_calls(model, ids, mask, monkeypatch)):
        causal_layer = enc.causal_prefix and layer < model.model_config.causal_layers
        if enc.relative or causal_layer:
            assert not q.is_nested and attn_mask is not None
        else:
            assert q.is_nested and k.is_nested and v.is_nested and attn_mask is None
            assert q.size(0) == 3 and q.offsets().tolist() == [0, 40, 65, 72]  # real tokens


@pytest.mark.parametrize("scale", [1 / 8, 1 / 128 ** 0.5, 1 / 256 ** 0.5],
                         ids=["bert", "tupe", "bert-a-d"])
def test_padding_column_fits_half_precision(scale):
    """A padded key's logit drops by PADDING_DROP and real keys' logits are unchanged, with the
    column's product within fp16's range even where a kernel would not sum in fp32."""
    padding = torch.tensor([[False, False, True]])
    query, key = kernel_layout.padding_columns(padding, scale)
    for dtype in (torch.float16, torch.bfloat16):
        q, k = query.to(dtype), key.to(dtype)
        product = (q * k).squeeze()  # computed in dtype
        assert torch.isfinite(product).all()
        logits = product.float() * scale
        assert logits[:2].eq(0).all()
        assert logits[2].item() == pytest.approx(-kernel_layout.PADDING_DROP, rel=0.01)


@pytest.mark.parametrize("device, multiple", [("cuda", 8), ("cpu", 1)])
def test_head_multiple_is_the_kernels_alignment(device, multiple):
    config = tupe_ds.ModelConfig(pos_encoding="tupe-a")
    assert kernel_layout.head_multiple(config, torch.device(device)) == multiple
    chosen = tupe_ds.ModelConfig(pos_encoding="tupe-a", head_multiple=64)
    assert kernel_layout.head_multiple(chosen, torch.device(device)) == 64


def test_bert_large_tupe_a_heads_widen_to_136():
    """BERT-Large's head size 64: 2 * 64 + 1 ([CLS]) = 129 and + 1 (padding) = 130, both padded
    to 136 on CUDA, not to 192."""
    d = 64
    untied = (torch.zeros(1, 1, 4, d + 1), torch.zeros(1, 1, 4, d + 1))  # [positional, CLS]
    padding = kernel_layout.padding_columns(torch.zeros(2, 4, dtype=torch.bool), 1 / 128 ** .5)
    for pieces in ([untied], [untied, padding]):
        widened = kernel_layout.join_columns(pieces, 16, d, torch.bfloat16, 8, None)
        assert d + widened.query_columns.shape[-1] == 136 == d + widened.key_columns.shape[-1]


@pytest.mark.parametrize("device, columns", [("cuda", True), ("cpu", False)])
def test_untied_as_columns(device, columns):
    config = tupe_ds.ModelConfig(pos_encoding="tupe-a")
    assert kernel_layout.untied_as_columns(config, torch.device(device)) is columns
    forced = tupe_ds.ModelConfig(pos_encoding="tupe-a", untied_as_columns=not columns)
    assert kernel_layout.untied_as_columns(forced, torch.device(device)) is not columns


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="ModelConfig.attention: unknown attention 'flash'"):
        tupe_ds.ModelConfig(attention="flash")
