"""Fused elementwise kernels (torch.compile'd bias-dropout-add and bias-GELU) against eager."""

import contextlib
import math

import pytest
import torch
import torch._inductor.config
from megatron.core.fusions import fused_bias_dropout
from torch._dynamo.utils import counters

from test_attention import inputs, loss_logits_grads
from tupe_ds.model import config
from tupe_ds.model.attention import BiasGeluMLP
from tupe_ds.model.config import ModelConfig


@pytest.fixture
def compile_afresh():
    """compile_afresh(fallback_random): set inductor's `fallback_random` and start from no
    compiled graph and zeroed compile counters; drop the test's graphs after it. Dynamo does not
    guard on inductor's settings: a graph compiled under the other setting (by an earlier test)
    would be reused as it is."""
    with contextlib.ExitStack() as settings:

        def start(fallback_random: bool):
            torch._dynamo.reset()
            counters.clear()
            settings.enter_context(torch._inductor.config.patch(fallback_random=fallback_random))

        yield start
        torch._dynamo.reset()


def test_fused_elementwise_matches_eager(tiny_model, compile_afresh):
    """With dropout on, the fused model (compiled bias-dropout-add and bias-GELU) gives eager's
    loss, logits and gradients: its dropout drops the same elements and scales the kept ones by
    1/(1-p). `fallback_random` makes the compiled code draw its masks from eager's generator, in
    eager's order; attention dropout (eager SDPA in both models, no part of the fusion) stays off,
    so that a difference can only come from the fused kernels."""
    compile_afresh(fallback_random=True)
    ids, mask, labels = inputs(padded=True)
    eager = tiny_model("tupe-r", fused_elementwise=False, hidden_dropout=0.1)
    fused = tiny_model("tupe-r", fused_elementwise=True, hidden_dropout=0.1)
    assert isinstance(fused.encoder.block.layers[0].mlp, BiasGeluMLP)
    assert fused.encoder.block.layers[0].config.bias_dropout_fusion
    assert not isinstance(eager.encoder.block.layers[0].mlp, BiasGeluMLP)
    assert eager.training and fused.training
    torch.manual_seed(1)
    expected_loss, expected_logits, expected_grads = loss_logits_grads(eager, ids, mask, labels)
    torch.manual_seed(1)
    loss, logits, grads = loss_logits_grads(fused, ids, mask, labels)
    assert counters["stats"]["unique_graphs"] >= 2  # bias-dropout-add and bias-GELU, compiled
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_fused_dropout_statistics(compile_afresh):
    """megatron-core's compiled bias-dropout-add, with inductor's own random numbers (what
    training runs): out = residual + (x + bias) * mask / (1 - p), with a share p of elements
    dropped (within 5 binomial standard deviations), the gradient through the same mask, and a
    new mask at each call. That the mask differs from eager's under the same seed shows that the
    compiled code ran, not an eager fallback."""
    compile_afresh(fallback_random=False)
    p, shape = 0.1, (1024, 4, 256)  # [n, b, hidden]: 2^20 elements
    bias_dropout_add = fused_bias_dropout.get_bias_dropout_add(training=True, fused=True)
    assert bias_dropout_add is fused_bias_dropout.bias_dropout_add_fused_train
    generator = torch.Generator().manual_seed(0)
    # x + bias in [1, 3): a kept element always moves its residual, a dropped one leaves it
    x = (1 + torch.rand(shape, generator=generator)).requires_grad_()
    bias = torch.rand(shape[-1], generator=generator)
    residual = torch.randn(shape, generator=generator)

    torch.manual_seed(0)
    out = bias_dropout_add((x, bias), residual, p)
    assert counters["stats"]["unique_graphs"] == 1  # compiled by dynamo, in one graph
    assert not counters["graph_break"]
    kept = out != residual
    dropped_share = 1 - kept.double().mean().item()
    assert abs(dropped_share - p) <= 5 * math.sqrt(p * (1 - p) / kept.numel()), dropped_share
    torch.testing.assert_close(out, residual + (x + bias) * kept / (1 - p))
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept / (1 - p))

    again = bias_dropout_add((x, bias), residual, p)
    assert not torch.equal(again != residual, kept)
    torch.manual_seed(0)
    eager = fused_bias_dropout.get_bias_dropout_add(training=True, fused=False)
    assert not torch.equal(eager((x, bias), residual, p) != residual, kept)


@pytest.mark.parametrize("device, fused", [("cuda:0", True), ("cpu", False)])
def test_fusion_is_on_where_it_pays(monkeypatch, device, fused):
    """Left to itself (None), fusion follows the accelerator: on CUDA, off on a CPU."""
    monkeypatch.setattr(config, "accelerator_device", lambda: torch.device(device))
    assert ModelConfig().fuses_elementwise is fused
    assert ModelConfig(fused_elementwise=not fused).fuses_elementwise is not fused
