"""--micro-batch auto (tupe_ds/train/micro_batch.py): the candidates, the search and its
agreement over ranks, the probe on the tiny model in this process (a memory limit that nothing
fits, what DeepSpeed is handed), the choice kept in run.json or probed again, the pipeline
refused, tupe-compare's ramp left out. tests/test_loss_normalization.py trains its reference
layout with it: the split it chooses trains the same parameters as every other split."""

import dataclasses
import json
import os

import pytest
import torch

from tupe_ds.compare import recipes
from tupe_ds.distributed.parallel import accelerator_device, ensure_model_parallel
from tupe_ds.tools.errors import Refused
from tupe_ds.train import micro_batch
from tupe_ds.train.batch_ramp import RampSettings
from tupe_ds.train.checkpoint.resume import ResumePlan
from tupe_ds.train.config import load
from tupe_ds.train.ds_config import BatchSplit, micro_batch_candidates
from tupe_ds.train.engine import build_engine, build_model
from tupe_ds.train.micro_batch import Probe, largest_fitting
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.run_folder.description import describe_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
SIZES = [1, 2, 4, 8, 16, 32]


def test_candidates_divide_each_ranks_share_as_the_ramp_allows():
    assert micro_batch_candidates(256, 8, None) == [1, 2, 4, 8, 16, 32]
    assert micro_batch_candidates(96, 1, None) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    # a ramp grows by whole micro-batches of every rank: 64 and 64 + 64k, over dp 8
    assert micro_batch_candidates(512, 8, RampSettings(64, 64, 1000)) == [1, 2, 4, 8]


def test_the_modern_recipe_plans_no_ramp_on_a_micro_batch_chosen_later():
    """tupe-compare plans before any run starts: a ramp's steps are whole micro-batches."""
    flags, note = recipes.ramping((), BatchSplit(256, None, None, 8), steps=1000)
    assert flags == () and note == ("no batch ramp: the micro-batch is auto, chosen at each run's "
                                    "start, and every batch of a ramp is a multiple of micro-batch "
                                    "x data-parallel ranks; --micro-batch N allows one")


def linear(fixed, per_sample, budget, **measured):
    """A probe whose bytes grow linearly with the micro-batch, but where `measured` says
    otherwise (m8=...), against `budget`."""
    return lambda m: Probe(m, measured.get(f"m{m}", fixed + per_sample * m), budget)


def test_the_search_probes_two_then_the_largest_predicted_to_fit():
    chosen, made = largest_fitting(SIZES, linear(10, 3, budget=40))
    assert SIZES[chosen] == 8 and [p.micro_batch for p in made] == [1, 2, 8]
    chosen, made = largest_fitting(SIZES, linear(10, 3, budget=1000))
    assert SIZES[chosen] == 32 and [p.micro_batch for p in made] == [1, 2, 32]
    # a size predicted to fit that does not: the next smaller one, measured
    chosen, made = largest_fitting(SIZES, linear(10, 3, budget=40, m8=float("inf")))
    assert SIZES[chosen] == 4 and [p.micro_batch for p in made] == [1, 2, 8, 4]
    chosen, made = largest_fitting(SIZES, linear(10, 3, budget=12))
    assert chosen == -1 and [p.micro_batch for p in made] == [1]


def test_every_rank_takes_the_same_decisions_from_the_agreed_figures():
    """Each probe as micro_batch.agreed makes it from every rank's figures: the tightest
    rank's. Ranks with other memory and other activations end with one micro-batch, the largest
    that fits on all, after the same probes."""
    ranks = [linear(10, 3, budget=40), linear(12, 2, budget=30), linear(4, 4, budget=70)]

    def agreed(m):
        return max((rank(m) for rank in ranks), key=lambda probe: probe.over)

    alone = [SIZES[largest_fitting(SIZES, rank)[0]] for rank in ranks]
    assert alone == [8, 8, 16]
    searches = [largest_fitting(SIZES, agreed) for _ in ranks]
    assert searches[0] == searches[1] == searches[2] and SIZES[searches[0][0]] == 8


def flags(data, out, *extra):
    return ["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out),
            "--steps", "3", "--seq-len", "64", "--global-batch", "16", "--micro-batch", "auto",
            *extra]


@pytest.fixture(scope="module")
def probed(data, tmp_path_factory):
    """A run with --micro-batch auto, the model it trains (built as a start builds it), the run
    with the micro-batch the probe chose, and whether the random state was kept; in this
    process's one-rank gloo group (ensure_model_parallel)."""
    ensure_model_parallel(1)
    run = load(flags(data, tmp_path_factory.mktemp("auto") / "run"))
    assert run.ds_config["train_micro_batch_size_per_gpu"] == "auto"
    model = build_model(run, OBJECTIVES["mlm"])
    state = torch.random.get_rng_state()
    chosen = micro_batch.settled(run, model, OBJECTIVES["mlm"], accelerator_device())
    return run, model, chosen, torch.equal(torch.random.get_rng_state(), state)


def test_a_probe_chooses_keeps_the_random_state_and_hands_deepspeed_a_count(probed):
    run, model, chosen, random_state_kept = probed
    with pytest.raises(RuntimeError, match="chosen before the engine is built"):
        build_engine(run, OBJECTIVES["mlm"], accelerator_device(), model)
    assert random_state_kept and all(p.grad is None for p in model.parameters())
    split = chosen.batch_split
    assert (split.micro_batch, split.accumulation) == (16, 1)  # the tiny model fits whole
    assert (chosen.ds_config["train_micro_batch_size_per_gpu"],
            chosen.ds_config["gradient_accumulation_steps"]) == (16, 1)
    assert str(split).startswith("global batch 16 = micro-batch 16 x accumulation 1 x dp 1 (auto: "
                                 "the largest of 1, 2, 4, 8, 16 (divisors of each rank's 16 "
                                 "samples) that fits at seq 64 with 10% headroom: 16 needs ")
    probes = split.auto["probes"]
    assert [m for m, _ in probes] == [1, 2, 16] and 0 < probes[0][1] < probes[1][1] < probes[2][1]


def test_nothing_fits_says_what_to_change(probed):
    run, model, _, _ = probed
    with pytest.raises(Refused) as refused:
        micro_batch.settled(run, model, OBJECTIVES["mlm"], accelerator_device(), limit=2**20)
    message = str(refused.value)
    assert message.startswith("--micro-batch auto: not even micro-batch 1 fits at seq 64 with 10% "
                              "headroom on every rank (1 needs ")
    assert ("of 1.0 MiB of this node's available memory per process; the model states" in message
            and "by DeepSpeed's estimate for ZeRO stage 2 over 1 data-parallel rank(s)): shard "
            "them with --zero-stage 3, spread them over more GPUs, split the model with --tp, "
            "shorten --seq-len, or give --micro-batch N to train without the probe" in message)


def test_a_start_keeps_run_jsons_choice_for_its_layout_and_probes_another(data, probed):
    run, model, chosen, _ = probed
    os.makedirs(run.out, exist_ok=True)
    describe_run(chosen, lineage="test")
    with open(os.path.join(run.out, "run.json")) as f:
        recorded = json.load(f)["micro_batch"]
    assert recorded == {"size": 16, "auto": chosen.batch_split.auto}
    assert recorded["auto"]["layout"]["global_batch"] == 16
    # no checkpoint of the run behind the choice (its first step may have run out of memory):
    # probed again, and said
    fresh = micro_batch.settled(run, model, OBJECTIVES["mlm"], accelerator_device())
    assert fresh.batch_split.note.endswith("; probed again: run.json's choice of 16 has no "
                                           "checkpoint of this run behind it (a first step that "
                                           "ran out of memory, another model)")
    # resuming a checkpoint on the same layout: kept, not probed (nothing would fit in 1 byte)
    resumed = dataclasses.replace(run, resume_plan=ResumePlan(
        os.path.join(run.out, "checkpoints"), ("step2",), None, False))
    again = micro_batch.settled(resumed, model, OBJECTIVES["mlm"], accelerator_device(),
                                     limit=1)
    assert again.batch_split.micro_batch == 16
    assert again.batch_split.note.startswith("auto, kept from run.json for this layout: the "
                                             "largest of 1, 2, 4, 8, 16")
    # another global batch: probed again, and said
    other = dataclasses.replace(load(flags(data, run.out, "--global-batch", "8")),
                                resume_plan=resumed.resume_plan)
    changed = micro_batch.settled(other, model, OBJECTIVES["mlm"], accelerator_device())
    assert changed.batch_split.micro_batch == 8
    assert changed.batch_split.note.endswith("; probed again: the layout changed since run.json's "
                                             "choice of 16 (global_batch 16 -> 8)")


def test_auto_is_checked_before_any_work(data, tmp_path, monkeypatch):
    """A pipeline is refused (whether the flag or the config says auto), and so is a ramp that
    no micro-batch allows; --micro-batch takes a count or auto."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Refused, match=r"--pp 2: --micro-batch auto probes the whole model on "
                                         r"one device.*give --micro-batch N, a divisor of each "
                                         r"data-parallel rank's 16 samples"):
        load(flags(data, tmp_path, "--pp", "2", "--zero-stage", "1"))
    config = tmp_path / "auto.json"
    config.write_text(json.dumps({**json.loads(open(CPU_CONFIG).read()),
                                  "train_micro_batch_size_per_gpu": "auto"}))
    argv = flags(data, tmp_path, "--pp", "2", "--zero-stage", "1", "--ds-config", str(config))
    argv.remove("--micro-batch")
    argv.remove("auto")
    with pytest.raises(Refused, match=f"--pp 2: {config}'s micro-batch \"auto\" probes"):
        load(argv)
    with pytest.raises(Refused, match="START 3 is not a multiple of micro-batch 1 x 2"):
        load(flags(data, tmp_path, "--rampup-batch-size", "3", "4", "100"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    for wrong in ("0", "some"):
        with pytest.raises(SystemExit):
            load(flags(data, tmp_path, "--micro-batch", wrong))
    with pytest.raises(Refused, match="--loss-normalization micro-batch with --micro-batch "
                                         "auto: the mean of each micro-batch's mean depends on "
                                         "the split"):
        load(flags(data, tmp_path, "--loss-normalization", "micro-batch"))
    with pytest.raises(Refused, match="--global-batch 0: give a count of samples"):
        load(flags(data, tmp_path, "--global-batch", "0"))
