"""ELECTRA: shared embedding, sampling without gradient, labels, tp, and a tiny run that learns."""

import shutil

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from test_pretrain import assert_tp2_matches_tp1, log, train
from tupe_ds.model.electra import ElectraForPretraining, build_electra


def masked_batch(vocab=512, batch=3, n=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    original = torch.randint(10, vocab, (batch, n), generator=generator)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[2, 15:] = 0
    chosen = (torch.rand(batch, n, generator=generator) < 0.3) & (mask == 1)
    chosen[:, 0] = False
    return original.masked_fill(chosen, 4), mask, original.masked_fill(~chosen, -100), original


def tiny_electra(**overrides):
    torch.manual_seed(0)
    return build_electra("tiny", hidden_dropout=0.0, attention_dropout=0.0, **overrides)


def test_one_embedding_receives_gradients_from_both_losses():
    model = tiny_electra()
    embeddings = [p for n, p in model.named_parameters() if "word_embeddings" in n]
    assert len(embeddings) == 1  # one tensor, shared
    weight = embeddings[0]
    ids, mask, labels, _ = masked_batch()
    for name in ("generator_loss", "discriminator_loss"):
        model.zero_grad(set_to_none=True)
        _, output = model(ids, mask, labels)
        getattr(output, name).backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0, name
    # the generator reads it through its projection, the discriminator directly
    assert model.generator_projection.weight.shape == (32, 64)


def test_the_sample_carries_no_gradient_and_labels_follow_replacements(monkeypatch):
    model = tiny_electra()
    ids, mask, labels, original = masked_batch()
    masked = labels.transpose(0, 1) != -100
    truth = original.transpose(0, 1)[masked]
    # The generator "samples" the original at even masked positions, another token at odd ones.
    faked = truth.clone()
    faked[1::2] = (faked[1::2] + 1) % 512
    seen = {}

    def fake_sample(local_logits):
        seen["requires_grad"] = local_logits.requires_grad
        return faked, faked

    monkeypatch.setattr(model, "sample", fake_sample)
    captured = {}
    original_forward = model.discriminator.forward

    def spy(hidden, padding):
        captured["hidden"] = hidden
        return original_forward(hidden, padding)

    monkeypatch.setattr(model.discriminator, "forward", spy)
    loss, output = model(ids, mask, labels)
    replaced, tokens = output.metrics["replaced_fraction"]
    assert replaced == len(truth[1::2])  # only the samples that differ count as replaced
    assert tokens == mask.sum()
    assert seen["requires_grad"]  # the logits have a gradient ...
    real_sample = ElectraForPretraining.sample(model, torch.randn(5, 512, requires_grad=True))
    assert not real_sample[0].requires_grad  # ... the sample does not
    assert torch.isfinite(loss)


def test_sampling_follows_the_generator_distribution():
    model = tiny_electra()
    logits = torch.full((2000, 512), -1e4)
    logits[:, 7] = 0.0
    logits[:1000, 9] = 0.0  # first half: 7 or 9 with equal odds
    sample, argmax = model.sample(logits)
    assert set(sample[1000:].tolist()) == {7}
    share = (sample[:1000] == 9).float().mean().item()
    assert 0.4 < share < 0.6


def test_tiny_electra_run_learns(data, tmp_path):
    out = tmp_path / "electra"
    train("deepspeed", 2, data, out, "--objective", "electra", "--steps", "100", "--lr", "5e-4",
          "--warmup-steps", "20", "--eval-interval", "100", "--eval-samples", "128",
          "--image-interval", "100")
    entries = log(out)

    def mean(name, steps):
        return sum(entries[s][name] for s in steps) / len(steps)

    first, last = range(1, 6), range(96, 101)
    assert mean("train/generator_loss", last) < mean("train/generator_loss", first) - 0.5
    assert mean("train/discriminator_loss", last) < mean("train/discriminator_loss", first)
    valid = entries[100]
    assert valid["valid/discriminator_accuracy"] > 1 - valid["valid/replaced_fraction"] + 0.005
    events = EventAccumulator(str(out / "tensorboard" / "tupe"), size_guidance={"images": 0}).Reload()
    for network in ("discriminator", "generator"):
        assert f"positional_logits/{network}/head0" in events.Tags()["images"]
    for name in ("generator_loss", "discriminator_loss", "generator_accuracy", "replaced_fraction",
                 "discriminator_accuracy", "discriminator_precision", "discriminator_recall"):
        assert f"train/{name}" in events.Tags()["scalars"] and f"valid/{name}" in events.Tags()["scalars"]


def test_electra_tensor_parallel_two_equals_one(data, tmp_path):
    assert_tp2_matches_tp1(data, tmp_path, 3, ["train/generator_loss", "train/discriminator_loss"],
                           "--objective", "electra")


def test_electra_checkpoints_hold_both_networks(data, tmp_path):
    """Resume a copy of a finished run from its step-4 checkpoint: steps 5 and 6 come out the same
    only if both networks, the optimizer and the data position were restored."""
    flags = ["--objective", "electra", "--steps", "6", "--save-interval", "2", "--eval-interval", "100"]
    train("deepspeed", 2, data, tmp_path / "whole", *flags)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "whole" / "checkpoints", copy / "checkpoints")
    shutil.rmtree(copy / "checkpoints" / "step6")
    (copy / "checkpoints" / "latest").write_text("step4")
    stdout = train("deepspeed", 2, data, copy, *flags)
    assert "resumed at step 4 of 6" in stdout
    whole, resumed = log(tmp_path / "whole"), log(copy)
    assert set(resumed) == {5, 6}
    for step in (5, 6):
        for name in ("train/generator_loss", "train/discriminator_loss"):
            assert resumed[step][name] == pytest.approx(whole[step][name], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("encoding", ["bert-a", "bert-r", "tupe-a", "tupe-a-tie-cls", "bert-a-d",
                                      "nope", "mask-nope", "rope"])
def test_every_encoding_trains_in_both_networks(encoding):
    model = tiny_electra(pos_encoding=encoding)
    assert model.generator.positional is not model.discriminator.positional
    ids, mask, labels, _ = masked_batch()
    loss, output = model(ids, mask, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
