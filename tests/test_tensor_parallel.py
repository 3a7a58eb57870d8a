"""tp=2 under torchrun (2 gloo processes) against tp=1 in this process: same seed, fp32; and
dropout under tp=2: each rank's heads draw their own attention dropout, hidden dropout agrees."""

import os
import subprocess
import sys

import pytest
import torch

import tupe_ds
from tp_inputs import inputs

ENCODINGS = ["tupe-r", "tupe-a", "tupe-a:columns", "bert-a", "rope"]  # :columns as on CUDA
RUNS = ENCODINGS + ["dropout"]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", os.path.join(HERE, "support", "tp_worker.py"), str(out), *RUNS]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {(enc, rank): torch.load(out / f"{enc}.rank{rank}.pt")
            for enc in RUNS for rank in (0, 1)}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.slow
def test_tp2_matches_tp1(tp2_results, encoding):
    torch.manual_seed(0)
    model = tupe_ds.build_model("tiny", pos_encoding=encoding.partition(":")[0], hidden_dropout=0.0,
                                attention_dropout=0.0,
                                untied_as_columns=True if encoding.endswith(":columns") else None)
    ids, mask, labels = inputs()
    loss, logits = model(ids, mask, labels)
    loss.backward()
    for rank in (0, 1):
        result = tp2_results[encoding, rank]
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["logits"], logits.detach(), rtol=1e-5, atol=1e-5)
        grads = result["grads"]
        assert set(grads) == {name for name, _ in model.named_parameters()}
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-5, msg=name)
        has_scores = model.model_config.encoding.has_positional_logits
        assert ("scores" in result) == has_scores, "tp=2 must save the scores it has"
        if has_scores:
            torch.testing.assert_close(result["scores"], model.positional_scores(16), rtol=1e-5,
                                       atol=1e-5)


def test_tp2_dropout_differs_per_head_and_agrees_outside(tp2_results):
    """Attention dropout (inside the tensor-parallel region) draws from each rank's own generator:
    the ranks' heads get different masks. Hidden dropout (on replicated activations) draws from
    the default generator, seeded alike: the encoder's output is the same on both ranks."""
    masks = [tp2_results["dropout", rank]["attention_masks"] for rank in (0, 1)]
    for mask in masks:
        assert set(mask.unique().round().tolist()) == {0.0, 1.0}
        torch.testing.assert_close(mask, mask.round())  # kept values are exactly 1 / (1 - p)
        assert abs(mask.mean().item() - 0.5) < 0.05  # p = 0.5 over 4096 draws: 6 sd
    assert (masks[0] == masks[1]).float().mean() < 0.6  # independent: about half agree
    hidden = [tp2_results["dropout", rank]["encoder_output"] for rank in (0, 1)]
    assert torch.equal(hidden[0], hidden[1])
    without_dropout = tp2_results["dropout", 0]["encoder_output_without_dropout"]
    assert not torch.allclose(hidden[0], without_dropout)  # dropout was on
