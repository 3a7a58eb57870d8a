"""bench/padding.py's counts against the packed samples' own lengths, and bench/real_lengths.py's
draws against bench/sample_lengths.json."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def bench_module(name: str):
    """bench/NAME.py, loaded from its path (bench/ stays off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


padding = bench_module("padding")
real_lengths_module = bench_module("real_lengths")
real_lengths, padding_mask = real_lengths_module.real_lengths, real_lengths_module.padding_mask
SEQ = 64


@pytest.fixture(scope="module")
def packed_lengths(data):
    """The length of every packed train sample at SEQ, read one by one (the reference)."""
    batches = padding.train_batches(data, SEQ, 1, 1, data)
    packed = batches.samples.packed
    return np.array([len(packed[k]) for k in range(len(packed))])


def test_one_epoch_counts_every_sample_once(data, packed_lengths):
    figures = padding.measure(data, SEQ, micro_batch=1, global_batch=1)
    assert figures["steps"] == figures["samples"] == len(packed_lengths)
    assert figures["packed_samples"] == len(packed_lengths)
    assert figures["length_counts"] == np.bincount(packed_lengths, minlength=SEQ + 1).tolist()
    assert figures["padded_samples"] == pytest.approx(np.mean(packed_lengths < SEQ))
    assert figures["padding_positions"] == pytest.approx(1 - packed_lengths.mean() / SEQ)
    assert figures["length_median"] == np.median(packed_lengths)
    assert 0 < figures["padded_samples"] < 1  # the novel packs both full and padded samples


def test_micro_batches_are_the_loaders(data, packed_lengths):
    micro_batch, global_batch, steps = 8, 32, 5
    figures = padding.measure(data, SEQ, micro_batch, global_batch, steps)
    assert (figures["samples"], figures["micro_batches"]) == (steps * global_batch, steps * 4)
    order = padding.train_batches(data, SEQ, micro_batch, global_batch, data).samples.locate(
        np.arange(steps * global_batch))[1]
    lengths = packed_lengths[order].reshape(-1, micro_batch)
    assert figures["padded_micro_batches"] == pytest.approx(np.mean((lengths < SEQ).any(axis=1)))
    assert figures["length_mean"] == pytest.approx(lengths.mean())
    assert figures["length_p10"] == pytest.approx(np.percentile(lengths, 10))


def test_main_writes_the_table_json_and_histograms(data, tmp_path, capsys):
    out, histograms = tmp_path / "padding.json", tmp_path / "lengths.json"
    padding.main(["--data", data, "--seq-lens", "32,64", "--micro-batch", "4", "--global-batch",
                  "8", "--steps", "2", "--json", str(out), "--write-lengths", str(histograms)])
    assert capsys.readouterr().out.count(f"| {padding.corpus_name(data)} |") == 2
    results = json.loads(out.read_text())["results"]
    assert [(r["seq_len"], r["samples"]) for r in results] == [(32, 16), (64, 16)]
    written = json.loads(histograms.read_text())["seq_len"]
    assert [len(written[seq]["counts"]) for seq in ("32", "64")] == [33, 65]
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("seq", [128, 512, 64, 1024])
def test_real_lengths_range_shape_and_mask(seq):
    lengths = real_lengths(seq, 1000, torch.Generator().manual_seed(0))
    assert lengths.dtype == torch.int64 and lengths.shape == (1000,)
    assert 2 <= int(lengths.min()) and int(lengths.max()) <= seq
    mask = padding_mask(lengths, seq)
    assert mask.dtype == torch.int64 and mask.shape == (1000, seq)
    assert torch.equal(mask.sum(dim=1), lengths)
    assert torch.equal(mask[:, 0], torch.ones(1000, dtype=torch.int64))


def test_real_lengths_follow_the_recorded_histogram():
    with open(real_lengths_module.LENGTHS_FILE) as f:
        recorded = json.load(f)["seq_len"]
    for seq in (128, 512):
        lengths = real_lengths(seq, 200_000, torch.Generator().manual_seed(1)).double()
        assert float(lengths.mean()) == pytest.approx(recorded[str(seq)]["length_mean"], abs=0.5)
        counts = recorded[str(seq)]["counts"]
        assert float((lengths == seq).double().mean()) == pytest.approx(
            counts[seq] / sum(counts), abs=0.01)
    # 1024 is not recorded: 512's distribution scaled by 2
    scaled = real_lengths(1024, 200_000, torch.Generator().manual_seed(2)).double()
    assert float(scaled.mean()) == pytest.approx(2 * recorded["512"]["length_mean"], abs=1.0)


def test_real_lengths_repeat_for_a_seeded_generator():
    first, again, other = (real_lengths(128, 500, torch.Generator().manual_seed(seed))
                           for seed in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)
