"""The positional module: computed once, shared by all layers, readable per head."""

from unittest import mock

import pytest
import torch

import tupe_ds
from reference import positional_logits
from tupe_ds.model.positional import PositionalEncoding


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("num_layers", [1, 4])
@pytest.mark.parametrize("encoding", ["tupe-r", "bert-a-d", "bert-r"])
def test_positional_module_runs_once_per_forward(tiny_model, encoding, num_layers):
    model = tiny_model(encoding, num_layers=num_layers)
    ids = torch.randint(5, 512, (2, 16))
    calls = []
    original = PositionalEncoding.attention_bias

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with mock.patch.object(PositionalEncoding, "attention_bias", counting):
        model(ids)[0].sum().backward()
    assert len(calls) == 1
    used = [p for p in model.encoder.positional.parameters() if p.grad is not None]
    assert used and all(p.grad.abs().sum() > 0 for p in used)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_tupe_parameter_overhead_does_not_grow_with_depth(num_layers):
    size = dict(hidden_size=768, num_attention_heads=12, ffn_hidden_size=64, vocab_size=64,
                max_position_embeddings=512, seq_length=512, num_layers=num_layers)
    count = {enc: n_params(tupe_ds.build_model("tiny", pos_encoding=enc, **size))
             for enc in ("nope", "bert-a", "tupe-a")}
    d, n = 768, 512
    # U^Q, U^K (2 d^2), p (n d), LayerNorm of p (2 d), p_th1 and p_th2 (2 d).
    assert count["tupe-a"] - count["nope"] == 2 * d * d + n * d + 4 * d
    # Over BERT-A, which has p already: the paper's "about 1.18M" for BERT-Base.
    assert round((count["tupe-a"] - count["bert-a"]) / 1e6, 2) == 1.18


def test_positional_scores_match_equations_beyond_relative_range():
    torch.manual_seed(0)
    model = tupe_ds.build_model("tiny", pos_encoding="tupe-r", max_position_embeddings=300,
                                seq_length=300)
    scores = model.positional_scores(300)
    assert scores.shape == (4, 300, 300)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    expected = positional_logits(weights, model.model_config, 300)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # The [CLS] reset: one value per head for the whole first row, another for the first column.
    assert (scores[:, 0, :] == scores[:, 0, :1]).all()
    assert (scores[:, 1:, 0] == scores[:, 1:2, 0]).all()


@pytest.mark.parametrize("encoding", ["bert-a", "nope", "mask-nope", "rope"])
def test_positional_scores_explain_when_there_are_none(encoding):
    model = tupe_ds.build_model("tiny", pos_encoding=encoding)
    with pytest.raises(ValueError, match=f"pos_encoding='{encoding}' has no content-free"):
        model.positional_scores(8)
