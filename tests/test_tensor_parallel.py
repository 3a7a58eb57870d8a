"""tp=2 under torchrun (2 gloo processes) against tp=1 in this process: same seed, fp32."""

import os
import subprocess
import sys

import pytest
import torch

import tupe_ds
from tp_inputs import inputs
from tupe_ds.model import positional

ENCODINGS = ["tupe-r", "tupe-a", "tupe-a:columns", "bert-a", "rope"]  # :columns as on CUDA
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", os.path.join(HERE, "tp_worker.py"), str(out), *ENCODINGS]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {(enc, rank): torch.load(out / f"{enc}.rank{rank}.pt")
            for enc in ENCODINGS for rank in (0, 1)}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_tp2_matches_tp1(tp2_results, encoding, monkeypatch):
    if encoding.endswith(":columns"):
        monkeypatch.setattr(positional, "untied_as_columns", lambda device: True)
    torch.manual_seed(0)
    model = tupe_ds.build_model("tiny", pos_encoding=encoding.partition(":")[0], hidden_dropout=0.0,
                                attention_dropout=0.0)
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
