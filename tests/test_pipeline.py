"""Pipeline parallelism (--pp): stage balance, every encoding against one process, tied copies of
the positional module and the word embedding, tp x pp x dp layouts and resume, under torchrun
(2-4 CPU processes, tiny models, fp32; the one-process references without a launcher; the stage
balance under the deepspeed launcher). No test here is about a launcher (test_pretrain.py's and
test_launchers_obey.py's are), and torchrun's start costs half the deepspeed launcher's two."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tupe_ds
from runs import cut_back_to, environment, free_port, log, train
from tp_inputs import micro_batches
from tupe_ds.model.config import ENCODINGS, ModelConfig
from tupe_ds.model.pipeline import stage_layer_counts
from tupe_ds.model.pipeline_names import bert_name

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def test_stages_balance_the_head_against_the_layers():
    large = ModelConfig.from_preset("bert-large")  # head ~2.5 layers at s = 512, V = 32768
    assert stage_layer_counts(large, 4) == [7, 7, 6, 4]
    assert stage_layer_counts(large, 2) == [13, 11]
    assert stage_layer_counts(large, 24) == [1] * 24
    assert stage_layer_counts(ModelConfig.from_preset("tiny"), 2) == [1, 1]
    small_vocab = ModelConfig.from_preset("bert-large", vocab_size=128)  # the head costs ~nothing
    assert stage_layer_counts(small_vocab, 4) == [6, 6, 6, 6]
    with pytest.raises(ValueError, match="every stage holds at least one transformer layer"):
        stage_layer_counts(ModelConfig.from_preset("tiny"), 3)


# One SGD step (lr 1, no clipping) of 2 micro-batches on 2 stages of 2 layers, per encoding,
# against one process.

@pytest.fixture(scope="module")
def two_stage_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_worker")
    env = {**environment(), "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    run = subprocess.run([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port",
                          free_port(), os.path.join(HERE, "support", "pp_worker.py"), str(out),
                          *ENCODINGS],
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {(encoding, stage): torch.load(out / f"{encoding}.stage{stage}.pt")
            for encoding in ENCODINGS for stage in (0, 1)}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.slow
def test_every_encoding_on_two_stages_equals_one_process(two_stage_steps, encoding):
    torch.manual_seed(0)
    model = tupe_ds.build_model("tiny", num_layers=4, pos_encoding=encoding, hidden_dropout=0.0,
                                attention_dropout=0.0)  # 2 layers per stage
    batches = micro_batches(2)
    loss = sum(model(ids, mask, labels)[0] for ids, mask, labels in batches) / len(batches)
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 1.0 * param.grad  # the worker's SGD step
    params = dict(model.named_parameters())
    positional = {n for n in params if n.startswith("encoder.positional.")}
    for stage in (0, 1):
        result = two_stage_steps[encoding, stage]
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-5, atol=1e-5)
        assert result["positional_calls"] == len(batches), "once per stage and micro-batch"
        copies = {bert_name(name): value for name, value in result["tied"].items()}
        assert positional <= set(copies), stage  # each stage holds the whole positional module
        assert "embedding.word_embeddings.weight" in copies
        for name, value in copies.items():
            torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=f"stage {stage}: {name}")


# The training command with --pp: layouts, tied copies in the checkpoints, resume.

FLAGS = ["--pos-encoding", "tupe-r", "--steps", "5", "--dropout", "0", "--global-batch", "8",
         "--micro-batch", "4", "--lr", "2e-3", "--warmup-steps", "1", "--zero-stage", "1",
         "--eval-interval", "5", "--save-interval", "2", "--keep-checkpoints", "3"]
LAYOUTS = {"pp1": (1, []), "pp2": (2, ["--pp", "2"]), "tp2pp2": (4, ["--tp", "2", "--pp", "2"])}


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_runs")
    for name, (processes, flags) in LAYOUTS.items():
        # the one-process reference without a launcher, as typed (test_pretrain.py)
        train("torchrun" if processes > 1 else None, processes, data, root / name, *FLAGS,
              *flags)
    return root


@pytest.mark.slow
def test_pipeline_layouts_equal_one_process(runs):
    one = log(runs / "pp1")
    for name in ("pp2", "tp2pp2"):
        other = log(runs / name)
        for step in range(1, 6):
            for metric in ("train/loss", "train/grad_norm"):
                assert other[step][metric] == pytest.approx(one[step][metric], rel=1e-5,
                                                            abs=1e-5), (name, step, metric)
        assert other[5]["valid/loss"] == pytest.approx(one[5]["valid/loss"], rel=1e-5, abs=1e-5)
    assert one[5]["train/loss"] < one[1]["train/loss"] - 0.05  # the steps did train


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_tied_copies_are_identical_on_every_stage_after_training(runs, layout):
    """Stage 0 holds layers 0-3 of the pipeline (embedding, positional, layer, end), stage 1
    layers 4-7 (positional, layer, end, head): its checkpoint has one file per layer (and tp
    rank)."""
    step = runs / layout / "checkpoints" / "step5"
    whole = load(runs / "pp1" / "checkpoints" / "step5" / "mp_rank_00_model_states.pt")["module"]
    for tp_rank in range(2 if layout == "tp2pp2" else 1):
        suffix = f"-model_{tp_rank:02d}"
        first, second = (load(step / f"layer_{i:02d}{suffix}-model_states.pt") for i in (1, 4))
        assert first.keys() == second.keys()
        names = [n for n in first if torch.is_tensor(first[n])]  # not megatron's _extra_state
        assert len(names) == 7  # p, its LayerNorm (2), U^Q, U^K, theta's vectors, relative table
        for name in names:
            assert torch.equal(first[name], second[name]), name
        embedding = load(step / f"layer_00{suffix}-model_states.pt")[
            "embedding.word_embeddings.weight"]
        decoder = load(step / f"layer_07{suffix}-model_states.pt")["word_embeddings.weight"]
        assert torch.equal(embedding, decoder)
        if layout == "pp2":  # the trained copies are the one-process run's parameters
            for name in names:
                torch.testing.assert_close(first[name], whole[f"encoder.{name}"],
                                           rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_pipeline_run_resumes_from_its_checkpoint(runs, data, tmp_path):
    """A copy of the pp=2 run, resumed from its step-2 checkpoint, reproduces steps 3-5."""
    copy = cut_back_to(runs / "pp2", tmp_path / "copy", 2)
    (copy / "train_log.jsonl").unlink()  # the steps the resumed run logs alone
    stdout = train("torchrun", 2, data, copy, *FLAGS, "--pp", "2")
    assert "resumed at step 2 of 5" in stdout
    whole, resumed = log(runs / "pp2"), log(copy)
    assert set(resumed) == {3, 4, 5}
    for step in (3, 4, 5):
        assert resumed[step]["train/loss"] == pytest.approx(whole[step]["train/loss"], rel=1e-5,
                                                            abs=1e-6)


@pytest.mark.slow
def test_bf16_pipeline_follows_one_process(data, tmp_path):
    """bf16 (what GPUs train in; fp16 needs CUDA): 2 stages against one process, to bf16's
    precision."""
    with open(os.path.join(os.path.dirname(HERE), "ds_configs", "cpu_zero2.json")) as f:
        config = {**json.load(f), "bf16": {"enabled": True}}
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps(config))
    flags = [*FLAGS, "--steps", "3", "--ds-config", str(path)]  # the last value of a flag counts
    train(None, 1, data, tmp_path / "pp1", *flags)
    train("torchrun", 2, data, tmp_path / "pp2", *flags, "--pp", "2")
    one, two = log(tmp_path / "pp1"), log(tmp_path / "pp2")
    for step in (1, 2, 3):
        assert two[step]["train/loss"] == pytest.approx(one[step]["train/loss"], rel=1e-3), step
