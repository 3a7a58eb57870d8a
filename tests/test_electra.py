"""ELECTRA: shared embedding, sampling without gradient, labels, and a tiny run that learns
(tp and every other layout: test_loss_normalization.py)."""


import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runs import cut_back_to, log, shipped_config_in_fp32, train
from tupe_ds.data.masking import IGNORE_INDEX
from tupe_ds.distributed.parallel import seed_tensor_parallel_rng
from tupe_ds.model.electra import DISCRIMINATOR_WEIGHT, ElectraForPretraining, build_electra
from tupe_ds.model.layers import embed, labelled_positions, masked_lm_loss
from tupe_ds.train.objectives import OBJECTIVES


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
    return build_electra("tiny", **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


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

    def fake_sample(local_logits, draws):
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
    real_sample = ElectraForPretraining.sample(model, torch.randn(5, 512, requires_grad=True),
                                               torch.rand(5))
    assert not real_sample[0].requires_grad  # ... the sample does not
    assert torch.isfinite(loss)


def test_sampling_follows_the_generator_distribution():
    model = tiny_electra()
    logits = torch.full((2000, 512), -1e4)
    logits[:, 7] = 0.0
    logits[:1000, 9] = 0.0  # first half: 7 or 9 with equal odds
    sample, argmax = model.sample(logits, 1 - torch.rand(2000))
    assert set(sample[1000:].tolist()) == {7}
    share = (sample[:1000] == 9).float().mean().item()
    assert 0.4 < share < 0.6


def test_a_draw_picks_the_token_whose_share_of_the_distribution_holds_it():
    """Inverse-CDF sampling from the stream's draws in (0, 1]: tokens 7 and 9 hold (0, 0.5] and
    (0.5, 1]; the tokens of probability 0 around them are never drawn, at either end."""
    model = tiny_electra()
    draws = torch.tensor([2.0**-24, 0.5, 0.5 + 2.0**-23, 1.0])
    logits = torch.full((4, 512), -1e4)
    logits[:, 7] = logits[:, 9] = 0.0
    sample, _ = model.sample(logits, draws)
    assert sample.tolist() == [7, 7, 9, 9]


def forward_before_the_speed_work(model, input_ids, attention_mask, labels):
    """ElectraForPretraining.forward as it was before it stopped waiting for the device (boolean
    indexing, the generator's head on every token): loss and metrics."""
    max_positions = model.model_config.max_position_embeddings
    padding = None if attention_mask is None else attention_mask == 0
    labels = labels.transpose(0, 1)
    embedded = embed(model.embedding, input_ids, max_positions)
    hidden = model.generator(model.generator_projection(embedded), padding)
    logits = model.generator_head(hidden, model.embedding.word_embeddings.weight)
    generator_loss = masked_lm_loss(logits, labels)
    masked = labels != IGNORE_INDEX
    sampled, predicted_ids = model.sample(logits[masked], 1 - torch.rand(int(masked.sum())))
    original = torch.where(masked, labels, input_ids.transpose(0, 1))
    corrupted = input_ids.transpose(0, 1).masked_scatter(masked, sampled)
    replaced = corrupted != original
    hidden = model.discriminator(embed(model.embedding, corrupted.transpose(0, 1), max_positions),
                                 padding)
    scores = model.discriminator_head(hidden).squeeze(-1).float()
    real = torch.ones_like(labels, dtype=torch.bool) if padding is None else ~padding.t()
    discriminator_loss = F.binary_cross_entropy_with_logits(scores[real], replaced[real].float())
    loss = generator_loss + DISCRIMINATOR_WEIGHT * discriminator_loss
    with torch.no_grad():
        predicted = (scores > 0) & real
        replaced_real = replaced & real
        tokens, n_masked = real.sum(), masked.sum()
        metrics = {
            "loss": (loss.detach(), 1),
            "generator_loss": (generator_loss.detach() * n_masked, n_masked),
            "discriminator_loss": (discriminator_loss.detach() * tokens, tokens),
            "generator_accuracy": ((predicted_ids == labels[masked]).sum(), n_masked),
            "replaced_fraction": (replaced_real.sum(), tokens),
            "discriminator_accuracy": (((predicted == replaced) & real).sum(), tokens),
            "discriminator_precision": ((predicted & replaced_real).sum(), predicted.sum()),
            "discriminator_recall": ((predicted & replaced_real).sum(), replaced_real.sum()),
        }
    return loss, metrics


def seed_dropout(seed: int) -> None:
    """The same dropout draws for the next forward: hidden dropout's generator and attention's."""
    torch.manual_seed(seed)
    seed_tensor_parallel_rng(seed)


def test_losses_and_metrics_as_before_the_speed_work():
    """Five AdamW steps, dropout on, the training step's inputs (labelled positions from the host,
    no mask for an unpadded batch) against the forward as it was: the same losses and metrics."""
    objective = OBJECTIVES["electra"]
    models = [tiny_electra(hidden_dropout=0.1, attention_dropout=0.1) for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for step in range(5):
        ids, mask, labels, _ = masked_batch(seed=step)
        if step % 2:  # an unpadded batch: no mask at all
            mask = torch.ones_like(mask)
        batch = {"input_ids": ids, "labels": labels, "labelled": labelled_positions(labels)}
        seed_dropout(step)
        loss, output = models[0](ids, mask if step % 2 == 0 else None, labels, batch["labelled"])
        seed_dropout(step)
        expected_loss, expected = forward_before_the_speed_work(models[1], ids, mask, labels)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
        metrics = objective.metrics(batch, loss, output, share=1.0)
        assert set(metrics) == set(expected)
        for name, (value, count) in expected.items():
            torch.testing.assert_close(metrics[name][0].double(), value.double(), rtol=1e-6,
                                       atol=1e-6, msg=name)
            assert metrics[name][1] == count, name
        for model, optimizer, value in zip(models, optimizers, (loss, expected_loss)):
            optimizer.zero_grad()
            value.backward()
            optimizer.step()


# The run that learns: 100 steps in one process (nothing here concerns ranks; the shipped
# config's resume below runs on 2), a checkpoint at step 80 too, which a copy resumes from
# (test_electra_checkpoints_hold_both_networks[cpu-config]).
LEARNS = ["--objective", "electra", "--steps", "100", "--lr", "5e-4", "--warmup-steps", "20",
          "--eval-interval", "100", "--eval-samples", "128", "--image-interval", "100",
          "--save-interval", "80"]


@pytest.fixture(scope="module")
def electra_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("electra") / "electra"
    train(None, 1, data, out, *LEARNS)
    return out


@pytest.mark.slow
def test_tiny_electra_run_learns(electra_run):
    out = electra_run
    entries = log(out)

    def mean(name, steps):
        return sum(entries[s][name] for s in steps) / len(steps)

    first, last = range(1, 6), range(96, 101)
    assert mean("train/generator_loss", last) < mean("train/generator_loss", first) - 0.5
    assert mean("train/discriminator_loss", last) < mean("train/discriminator_loss", first)
    valid = entries[100]
    assert valid["valid/discriminator_accuracy"] > 1 - valid["valid/replaced_fraction"] + 0.005
    events = EventAccumulator(str(out / "tensorboard" / "tupe"),
                              size_guidance={"images": 0}).Reload()
    for network in ("discriminator", "generator"):
        assert f"positional_logits/{network}/head0" in events.Tags()["images"]
    for name in ("generator_loss", "discriminator_loss", "generator_accuracy", "replaced_fraction",
                 "discriminator_accuracy", "discriminator_precision", "discriminator_recall"):
        assert f"train/{name}" in events.Tags()["scalars"]
        assert f"valid/{name}" in events.Tags()["scalars"]


@pytest.mark.parametrize("config", [None, "electra_base_fp16.json"],
                         ids=["cpu-config", "shipped-config"])
@pytest.mark.slow
def test_electra_checkpoints_hold_both_networks(data, tmp_path, config, request):
    """Resume a copy of a finished run from a checkpoint before its end: the steps after it come
    out the same only if both networks, the optimizer and the data position were restored. With
    the CPU config, the run that learns above, from step 80 (steps 81-100, the rate still at a
    quarter of its peak down to 0); with the shipped config's step (ZeRO-1 without gradient
    hooks, micro-batch from the config), a run of 6 steps on 2 ranks from step 4 (steps 5 and
    6)."""
    if config is None:
        flags, whole, checkpoint, last = LEARNS, request.getfixturevalue("electra_run"), 80, 100
        launcher, processes = None, 1  # as the run was
    else:
        launcher, processes = "torchrun", 2
        flags = ["--objective", "electra", "--steps", "6", "--save-interval", "2",
                 "--eval-interval", "100", "--ds-config", shipped_config_in_fp32(config, tmp_path),
                 "--global-batch", "8", "--warmup-steps", "2"]
        whole, checkpoint, last = tmp_path / "whole", 4, 6
        train(launcher, processes, data, whole, *flags)
    copy = cut_back_to(whole, tmp_path / "copy", checkpoint)
    (copy / "train_log.jsonl").unlink()  # the steps the resumed run logs alone
    stdout = train(launcher, processes, data, copy, *flags)
    assert f"resumed at step {checkpoint} of {last}" in stdout
    after = range(checkpoint + 1, last + 1)
    whole, resumed = log(whole), log(copy)
    assert set(resumed) == set(after)
    for step in after:
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
