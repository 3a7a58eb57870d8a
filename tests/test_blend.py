"""Blending several prepared folders into one stream (tupe_ds/data/blend.py, `--data W1 F1 W2
F2`): the schedule's shares over any window, the single-corpus stream as the oracle, the same
samples in every layout and after a resume, vocabularies checked, and a run that validates each
source and logs the shares."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tupe_ds.data.blend import PERIOD, BlendedSamples, Schedule, parse_sources, whole_shares
from tupe_ds.data.loader import MaskedSamples, TrainBatches, Vocabulary
from tupe_ds.data.masking import BERT_MASKING
from tupe_ds.data.packing import PackedSentences

from runs import log, train
from test_index_cache import write_corpus

WEIGHTS = [(0.7, 0.3), (1, 1, 1), (0.5, 0.3, 0.2), (0.999, 0.001), (3, 0, 1), (0.123, 0.877)]


@pytest.fixture(scope="module")
def second(data, tmp_path_factory):
    """Another novel, prepared with the first folder's tokenizer."""
    from data_prep.pipeline import PrepConfig, prepare

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("northanger")
    prepare(PrepConfig(inputs=[os.path.join(root, "data", "sample", "northangerabbey.txt.gz")],
                       output=str(out), tokenizer=os.path.join(data, "tokenizer.json"),
                       workers=1, valid_fraction=0.05, quiet=True))
    return str(out)


def streams(data, prefixes, cache, seq_len=64, seed=3):
    """The MaskedSamples of datasets at `prefixes`, with the vocabulary of the folder `data`."""
    vocab = Vocabulary.from_data_dir(data)
    return [MaskedSamples(PackedSentences(prefix, seq_len, vocab.cls, vocab.sep, str(cache)),
                          vocab, BERT_MASKING, seed) for prefix in prefixes]


def train_splits(*folders):
    return [os.path.join(folder, "train") for folder in folders]


def assert_same(one, other):
    assert one.keys() == other.keys()
    for key in one:
        torch.testing.assert_close(one[key], other[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_window_holds_each_source_within_2_samples_of_its_share(weights):
    schedule = Schedule(weights)
    assert schedule.per_period.sum() == PERIOD
    assert np.abs(schedule.per_period - np.array(weights) / sum(weights) * PERIOD).max() <= 1
    source, own = schedule.locate(np.arange(2 * PERIOD))
    for i, share in enumerate(schedule.per_period / PERIOD):
        mine = source == i
        # a source's own samples come in order, each once
        assert np.array_equal(own[mine], np.arange(mine.sum()))
        # over a window [a, b) the count differs from (b - a) x share by at most the spread of
        # (count so far - n x share) over n
        behind = np.concatenate([[0], np.cumsum(mine)]) - np.arange(2 * PERIOD + 1) * share
        assert behind.max() - behind.min() < 2, (weights, i)
    assert np.array_equal(schedule.counts(12345, PERIOD), schedule.per_period)


def test_weights_are_whole_shares_of_the_period_by_largest_remainders():
    assert whole_shares([1, 1, 1]).tolist() == [3334, 3333, 3333]
    assert whole_shares([0.7, 0.3]).tolist() == [7000, 3000]
    assert whole_shares([2, 0]).tolist() == [PERIOD, 0]


@pytest.mark.parametrize("values, message", [
    (["0.7", "a", "0.3"], "one folder, or pairs"),
    (["a", "b"], "'a' before b is not a weight"),
    (["-1", "a", "2", "b"], "the weight of a is -1"),
    (["0", "a", "0", "b"], "every weight is 0"),
    (["1", "a", "1", "a/"], "a folder is named twice"),
])
def test_a_wrong_data_flag_is_refused_with_what_to_write(values, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(values)


def test_sources_are_named_by_folder_and_numbered_where_names_repeat():
    names = [s.name for s in parse_sources(["1", "x/wiki", "1", "y/books", "1", "z/books"])]
    assert names == ["wiki", "books-2", "books-3"]
    assert [(s.folder, s.weight, s.name) for s in parse_sources(["prep/"])] == [
        ("prep/", 1.0, "prep")]


def test_one_source_and_a_weight_of_zero_give_the_single_corpus_stream(data, second,
                                                                       tmp_path):
    alone, other = streams(data, train_splits(data, second), tmp_path)
    crossing = len(alone.packed) - 5  # into the second epoch
    expected = alone.global_samples(crossing, 16)
    assert_same(BlendedSamples([alone], [1]).global_samples(crossing, 16), expected)
    assert_same(BlendedSamples([alone, other], [1, 0]).global_samples(crossing, 16), expected)
    assert_same(BlendedSamples([other, alone], [0, 2]).global_samples(crossing, 16), expected)


def test_each_row_is_its_sources_own_sample(data, second, tmp_path):
    sources = streams(data, train_splits(data, second), tmp_path)
    blended = BlendedSamples(sources, [0.7, 0.3])
    batch = blended.global_samples(100, 40)
    which, own = blended.schedule.locate(np.arange(100, 140))
    assert set(which.tolist()) == {0, 1}
    for row in range(40):
        expected = sources[which[row]].global_samples(int(own[row]), 1)
        assert_same({k: v[row:row + 1] for k, v in batch.items()}, expected)


def test_the_same_samples_in_every_layout_and_after_a_resume_at_any_step(data, tmp_path):
    """Global batch 8 over a stream whose smaller source runs through several epochs."""
    small = str(tmp_path / "small")
    write_corpus(small, seed=5, documents=12)
    sources = streams(data, [os.path.join(data, "train"), small], tmp_path)
    blended = BlendedSamples(sources, [0.6, 0.4])
    steps = 20

    def global_batches(micro, accumulation, dp, consumed=0, count=steps):
        ranks = [TrainBatches(blended, micro, accumulation, rank, dp, consumed=consumed)
                 for rank in range(dp)]
        return [torch.cat([b["input_ids"] for rank in ranks for b in rank.next_step()])
                for _ in range(count)]

    reference = global_batches(8, 1, 1)
    which, own = blended.schedule.locate(np.arange(steps * 8))
    assert own[which == 1].max() >= 3 * len(sources[1].packed)  # past 3 epochs of the small one
    for layout in ((4, 2, 1), (2, 2, 2), (1, 4, 2)):
        assert all(torch.equal(a, b) for a, b in zip(global_batches(*layout), reference)), layout
    for step in range(steps):
        resumed = global_batches(2, 2, 2, consumed=step * 8, count=1)[0]
        assert torch.equal(resumed, reference[step]), step


def other_vocabulary(data, tmp_path):
    copy = tmp_path / "other-vocabulary"
    shutil.copytree(data, copy)
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzzz-new-token"] = len(tokenizer["model"]["vocab"])
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(copy)


def test_a_blend_of_folders_with_different_tokenizers_is_refused_naming_both(data, tmp_path):
    from tupe_ds.train.config import CPU_CONFIG, load

    other = other_vocabulary(data, tmp_path)
    with pytest.raises(SystemExit, match=rf"{data}/tokenizer.json and {other}/tokenizer.json "
                                         "differ; a blend needs every folder prepared with one "
                                         "tokenizer"):
        load(["--data", "0.5", data, "0.5", other, "--model", "tiny", "--ds-config", CPU_CONFIG,
              "--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "64"])


def test_a_folder_with_an_empty_split_is_refused_before_work(data, tmp_path):
    from tupe_ds.train.config import CPU_CONFIG, load

    empty = tmp_path / "no-valid"
    shutil.copytree(data, empty)
    (empty / "valid.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match=rf"--data {empty}: its valid split holds no document; "
                                         "prepare it again with more text or a --valid-fraction"):
        load(["--data", "0.5", data, "0.5", str(empty), "--model", "tiny", "--ds-config",
              CPU_CONFIG, "--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "64"])


def test_a_blended_run_validates_each_source_and_logs_the_shares(data, second, tmp_path):
    """Two ranks, 6 steps of 16 samples on 0.75 / 0.25: valid/loss is the blend of the sources'
    validation losses, train/share/NAME the shares of each logged step's samples; resuming
    with other weights is refused before work."""
    from tupe_ds.train.config import CPU_CONFIG, load

    out = tmp_path / "run"
    stdout = train("torchrun", 2, data, out, "--steps", "6", "--global-batch", "16",
                   "--eval-interval", "6", "--data", "0.75", data, "0.25", second)
    first, other = os.path.basename(data), os.path.basename(second)
    assert f"train samples: {first} " in stdout and f"(75%), {other} " in stdout
    entries = log(out)
    shares = [(entries[s][f"train/share/{first}"], entries[s][f"train/share/{other}"])
              for s in range(1, 7)]
    assert all(a + b == pytest.approx(1) for a, b in shares)
    assert sum(a for a, _ in shares) / 6 == pytest.approx(0.75, abs=2 / 96)
    final = entries[6]
    assert final["valid/loss"] == pytest.approx(
        0.75 * final[f"valid/{first}/loss"] + 0.25 * final[f"valid/{other}/loss"], rel=1e-6)
    assert final[f"valid/{first}/loss"] != final[f"valid/{other}/loss"]
    description = json.loads((out / "run.json").read_text())
    assert [s["weight"] for s in description["sources"]] == [0.75, 0.25]
    with pytest.raises(SystemExit, match=r"the data \(--data\): other content than the "
                                         r"checkpoint's \(data.blend\[0\].per_period\)"):
        load(["--data", "0.5", data, "0.5", second, "--model", "tiny", "--ds-config", CPU_CONFIG,
              "--out", str(out), "--steps", "7", "--seq-len", "64", "--global-batch", "16"],
             world_size=2)
