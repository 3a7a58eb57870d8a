"""Fused elementwise kernels (torch.compile'd bias-dropout-add and bias-GELU) against eager."""

import pytest
import torch

from test_attention import inputs, loss_logits_grads
from tupe_ds.model import config
from tupe_ds.model.attention import BiasGeluMLP
from tupe_ds.model.config import ModelConfig


def test_fused_elementwise_matches_eager(tiny_model):
    ids, mask, labels = inputs(padded=True)
    eager = tiny_model("tupe-r", fused_elementwise=False)
    fused = tiny_model("tupe-r", fused_elementwise=True)
    assert isinstance(fused.encoder.block.layers[0].mlp, BiasGeluMLP)
    assert fused.encoder.block.layers[0].config.bias_dropout_fusion
    assert not isinstance(eager.encoder.block.layers[0].mlp, BiasGeluMLP)
    expected_loss, expected_logits, expected_grads = loss_logits_grads(eager, ids, mask, labels)
    loss, logits, grads = loss_logits_grads(fused, ids, mask, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("device, fused", [("cuda:0", True), ("cpu", False)])
def test_fusion_is_on_where_it_pays(monkeypatch, device, fused):
    """Left to itself (None), fusion follows the accelerator: on CUDA, off on a CPU."""
    monkeypatch.setattr(config, "accelerator_device", lambda: torch.device(device))
    assert ModelConfig().fuses_elementwise is fused
    assert ModelConfig(fused_elementwise=not fused).fuses_elementwise is not fused
