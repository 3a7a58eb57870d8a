"""Blending several prepared folders into one stream (tupe_ds/data/blend.py, `--data W1 F1 W2
F2`): every positive weight drawn at its share, each source within its bound of it at any sample
(weights over 8 decades, token counts too), the single-corpus stream as the oracle, the same
samples in every layout and after a resume, the sources' names, vocabularies checked, a run that
validates each source and logs the shares, and DATA through pretrain.sbatch."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tupe_ds.data.blend import BlendedSamples
from tupe_ds.data.blend_schedule import PERIOD, Schedule, whole_shares
from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.data.masking import BERT_MASKING, MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.data.sources import parse_sources
from tupe_ds.tools.errors import Refused

from runs import log, train
from test_index_cache import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = [(0.7, 0.3), (1, 1, 1), (0.5, 0.3, 0.2), (0.999, 0.001), (3, 0, 1), (0.123, 0.877),
           (1, 4e-5), (3.2e9, 4e6), (3, 6e-5, 6e-5), (1e11, 4e6, 4e6, 2e7)]
# a web corpus and five small domain ones: Megatron's rule (the schedule before) put one of them
# 1.67 samples off its share
SIX = (0.9591, 0.0148, 0.0111, 0.0068, 0.0065, 0.0018)


@pytest.fixture(scope="module")
def second(data, tmp_path_factory):
    """Another novel, prepared with the first folder's tokenizer."""
    from data_prep.pipeline import PrepConfig, prepare

    out = tmp_path_factory.mktemp("northanger")
    prepare(PrepConfig(inputs=[os.path.join(ROOT, "data", "sample", "northangerabbey.txt.gz")],
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


def assert_within_bounds(schedule, first, count):
    """Global samples [first, first + count): each source's own samples come in order, each once,
    and at each of its draws its count of the samples before g (k) and through g (k + 1) is
    within `within` of g x share (exactly: counts scaled by PERIOD)."""
    source, own = schedule.locate(np.arange(first, first + count))
    for i, size in enumerate(schedule.per_period):
        mine = np.flatnonzero(source == i)
        if not size:
            assert not mine.size
            continue
        if mine.size:
            assert np.array_equal(own[mine], own[mine[0]] + np.arange(mine.size))
        k, g = own[mine].astype(object), (first + mine).astype(object)  # Python's exact ints
        bound = schedule.within[i] * PERIOD
        assert max(np.abs(k * PERIOD - g * int(size)), default=0) <= bound, (i, first)
        assert max(np.abs((k + 1) * PERIOD - (g + 1) * int(size)), default=0) <= bound
    return source


@pytest.mark.parametrize("weights", WEIGHTS + [SIX])
def test_each_source_is_within_one_sample_of_its_share_at_any_sample(weights):
    schedule = Schedule(weights)
    shares = np.array(weights) / sum(weights)
    assert schedule.per_period.sum() == PERIOD
    assert np.abs(schedule.per_period - shares * PERIOD).max() <= 1
    assert ((schedule.per_period > 0) == (shares > 0)).all()  # every positive weight draws
    assert schedule.within.max() < 1
    for first in (0, 12345, PERIOD - 2000, 3 * PERIOD + 7, 2 ** 45):
        source = assert_within_bounds(schedule, first, 4000)
        # hence over any window, each count is within 2 x within of window x share
        window = np.bincount(source[1000:3500], minlength=len(weights))
        assert (np.abs(window - 2500 * schedule.per_period / PERIOD)
                <= 2 * schedule.within).all()
    g = np.random.default_rng(0).integers(0, 2 ** 50, 1000)
    source, own = schedule.locate(g)
    later, own_later = schedule.locate(g + PERIOD)  # a period on, each source has its share more
    assert np.array_equal(later, source)
    assert np.array_equal(own_later, own + schedule.per_period[source])


@st.composite
def blends(draw):
    """2 to 6 weights over 8 decades, as fractions or token counts, some of them 0."""
    scale = draw(st.sampled_from([1e-6, 1.0, 1e9]))
    weight = st.one_of(st.just(0.0), st.tuples(st.floats(1, 10), st.integers(0, 7)).map(
        lambda drawn: drawn[0] * 10.0 ** drawn[1] * scale))
    weights = draw(st.lists(weight, min_size=2, max_size=6))
    return weights if sum(weights) else weights + [scale]


@settings(max_examples=40, deadline=None)
@given(blends(), st.integers(0, 2 ** 50))
def test_any_weights_keep_each_source_within_its_bound_and_under_1_up_to_four(weights, first):
    schedule = Schedule(weights)
    shares = np.array(weights) / sum(weights)
    assert ((schedule.per_period > 0) == (shares > 0)).all()
    if (shares > 0).sum() <= 4:
        assert schedule.within.max() < 1
    assert_within_bounds(schedule, first, 3000)


def test_weights_are_whole_shares_of_the_period_by_largest_remainders():
    assert whole_shares([1, 1, 1]).tolist() == [715827883, 715827883, 715827882]
    assert whole_shares([0.75, 0.25]).tolist() == [3 * PERIOD // 4, PERIOD // 4]
    assert whole_shares([2, 0]).tolist() == [PERIOD, 0]


@pytest.mark.parametrize("values, message", [
    (["0.7", "a", "0.3"], "one folder, or pairs"),
    (["a", "b"], "'a' before b is not a weight"),
    (["-1", "a", "2", "b"], "the weight of a is -1"),
    (["0", "a", "0", "b"], "every weight is 0"),
    (["1", "a", "1", "a/"], "a folder is named twice"),
    (["1", "a", "4e-10", "b"], r"the weight of b, 4e-10, is 4e-10 of the total, below the "
                               r"blend's resolution \(a sample in 2\^31\)"),
    (["1e308", "a", "1e308", "b"], "add up to more than a float holds"),
    (["1", "x/books", "1", "y/books"], "x/books and y/books are both named books; name one: "
                                      "NAME=y/books"),
    (["1", "wiki=a", "1", "wiki=b"], "wiki=a and wiki=b are both named wiki"),
    (["1", "my wiki=a", "1", "b"], r"--data my wiki=a: 'my wiki' is not a source name \(letters, "
                                   r"digits, '.', '_' and '-', from a letter or digit\)$"),
    (["1", "x/my wiki", "1", "b"], "--data x/my wiki: 'my wiki' is not a source name .*; name "
                                   "the source: NAME=x/my wiki"),
    (["1", "x/a=b", "1", "c"], "'a=b' is not a source name .*; name the source: NAME=x/a=b"),
    (["1", "wiki=", "1", "b"], "--data wiki=: no folder after the name"),
    (["-x=a"], "'-x' is not a source name"),
])
def test_a_wrong_data_flag_is_refused_with_what_to_write(values, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(values)


def test_sources_carry_the_names_given_else_their_folders_or_above_a_merged_one():
    from tupe_ds.compare.cli import absolute_data

    sources = parse_sources(["3.2e9", "prep/wiki/merged", "4e6", "law=prep/l2", "8e8", "books",
                             "1e8", "n=x/a=b"])
    assert [(s.folder, s.weight, s.name) for s in sources] == [
        ("prep/wiki/merged", 3.2e9, "wiki"), ("prep/l2", 4e6, "law"), ("books", 8e8, "books"),
        ("x/a=b", 1e8, "n")]
    assert [(s.folder, s.weight, s.name) for s in parse_sources(["prep/"])] == [
        ("prep/", 1.0, "prep")]
    assert parse_sources(["wiki=prep/"])[0].name == "wiki"
    assert parse_sources(["x/my data"])[0].name == "my data"  # alone: no tag carries it
    assert absolute_data(["3.2e9", "wiki=prep/wiki", "1", "prep/books/merged"]) == (
        "3.2e9", f"wiki={os.path.abspath('prep/wiki')}", "1",
        os.path.abspath("prep/books/merged"))


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
    with pytest.raises(Refused, match=rf"{data}/tokenizer.json and {other}/tokenizer.json "
                                         "differ; a blend needs every folder prepared with one "
                                         "tokenizer"):
        load(["--data", "0.5", data, "0.5", other, "--model", "tiny", "--ds-config", CPU_CONFIG,
              "--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "64"])


def test_a_folder_with_an_empty_split_is_refused_before_work(data, tmp_path):
    from tupe_ds.train.config import CPU_CONFIG, load

    empty = tmp_path / "no-valid"
    shutil.copytree(data, empty)
    (empty / "valid.bin").write_bytes(b"")
    with pytest.raises(Refused, match=rf"--data {empty}: its valid split holds no document; "
                                         "prepare it again with more text or a --valid-fraction"):
        load(["--data", "0.5", data, "0.5", str(empty), "--model", "tiny", "--ds-config",
              CPU_CONFIG, "--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "64"])


@pytest.mark.slow
def test_a_blended_run_validates_each_source_and_logs_the_shares(data, second, tmp_path):
    """One process, 6 steps of 16 samples on 0.75 / 0.25, the second source named novel: valid/loss
    is the blend of the sources' validation losses, train/share/NAME the shares of each logged
    step's samples; the same run on 2 ranks (each its share of every step's blend, and of each
    source's validation) logs the same shares and, within fp32's summation order, the same
    losses; resuming with other weights is refused before work."""
    from tupe_ds.train.config import CPU_CONFIG, load

    out = tmp_path / "run"
    flags = ["--steps", "6", "--global-batch", "16", "--eval-interval", "6", "--dropout", "0",
             "--data", "0.75", data, "0.25", f"novel={second}"]
    stdout = train(None, 1, data, out, *flags)
    first, other = os.path.basename(data), "novel"
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
    train("torchrun", 2, data, tmp_path / "two-ranks", *flags)
    two_ranks = log(tmp_path / "two-ranks")
    assert {step: set(entry) for step, entry in two_ranks.items()} == {
        step: set(entry) for step, entry in entries.items()}
    for step, entry in two_ranks.items():
        for metric, value in entry.items():
            if metric.startswith("train/share/"):
                assert value == entries[step][metric], (step, metric)
            elif metric.endswith("loss"):
                assert value == pytest.approx(entries[step][metric], rel=1e-5), (step, metric)
    description = json.loads((out / "run.json").read_text())
    assert [(s["folder"], s["weight"], s["name"]) for s in description["sources"]] == [
        (data, 0.75, first), (second, 0.25, "novel")]
    with pytest.raises(Refused, match=r"the data \(--data\): other content than the "
                                         r"checkpoint's \(data.blend\[0\].per_period\)"):
        load(["--data", "0.5", data, "0.5", second, "--model", "tiny", "--ds-config", CPU_CONFIG,
              "--out", str(out), "--steps", "7", "--seq-len", "64", "--global-batch", "16"],
             world_size=1)


def stand_in_python_and_srun(folder) -> dict:
    """An environment whose python and srun (in `folder`) print the arguments they are given."""
    for program in ("python", "srun"):
        (folder / program).write_text('#!/usr/bin/env python3\nimport json, sys\n'
                                      'print(json.dumps(sys.argv[1:]))\n')
        (folder / program).chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "PYTHON": "python",
            "TUPE_DS_ROOT": ROOT}


def test_pretrain_script_passes_token_count_weights_and_named_folders(tmp_path):
    """DATA of pretrain.sbatch with weights in e-notation (token counts) and NAME=FOLDER: --data's
    values as written. A stand-in python and srun print what they are given."""
    env = stand_in_python_and_srun(tmp_path)
    expected = ["3.2e9", "/p/wiki/merged", "4E+6", "law=/p/l2"]
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "pretrain.sbatch"), "bert-large",
                             " ".join(expected), "/runs/x"], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    commands = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(commands) == 2  # the check, then the step
    for argv in commands:
        start = argv.index("--data") + 1
        assert argv[start:start + 5] == [*expected, "--out"], argv


def test_real_tokens_are_what_the_batches_hold_without_their_padding(data, second, tmp_path,
                                                                      monkeypatch):
    """Counted from the index alone (PackedSentences.lengths), in chunks: each source's and the
    blend's, across an epoch's end, equal the attention masks' sums."""
    from tupe_ds.data import masking

    monkeypatch.setattr(masking, "SAMPLES_AT_ONCE", 7)  # several chunks
    sources = streams(data, train_splits(data, second), tmp_path)
    blend = BlendedSamples(sources, [3, 1])
    for stream in (*sources, blend):
        first = len(sources[0].packed) - 20  # into the second epoch
        batch = stream.global_samples(first, 40)
        assert stream.real_tokens(first, 40) == int(batch["attention_mask"].sum())
        assert stream.real_tokens(first, 40) < 40 * batch["attention_mask"].shape[1]  # padding
