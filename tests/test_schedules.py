"""--lr-schedule {linear,cosine,wsd}, a decay branch (--init-from --branch) and the batch ramp
(--rampup-batch-size): every step's learning rate against the formula written out below, the
samples a ramp consumes, and a WSD run with a ramp resumed mid-ramp on another layout, then
branched into a decay from one of its checkpoints (the loss-normalisation test trains the ramp
on its layouts)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from deepspeed.runtime import lr_schedules

from runs import CPU_CONFIG, EXIT_WORKER, environment, free_port, log, train
from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.data.masking import BERT_MASKING, MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.export.consolidate import consolidated_state
from tupe_ds.tools.errors import Refused
from tupe_ds.train.batch_ramp import BatchRamp, RampSettings
from tupe_ds.train.config import load
from tupe_ds.train.schedule import client_scheduler

PEAK, LOW, WARMUP = 1e-3, 1e-5, 4


def expected_lr(kind: str, step: int, steps: int, decay: int = 0, warmup: int = WARMUP) -> float:
    """The rate optimizer step `step` (from 1) of a run of `steps` runs with: the warmup as
    DeepSpeed's WarmupLR gives it (the first two steps at the minimum, then linear), then
    linear: to the minimum 2 steps after --steps (DeepSpeed's WarmupDecayLR); cosine: DeepSpeed's
    WarmupCosineLR; wsd-*: the peak, then the last `decay` steps falling from the peak (the
    first) towards the minimum (the step after the last)."""
    i = step - 2  # DeepSpeed's last_batch_iteration when the step runs
    if i < 0:
        return 0.0 if kind == "cosine" else LOW  # WarmupCosineLR's ratio before it started
    if i < warmup:
        return LOW + (PEAK - LOW) * i / warmup
    if kind == "linear":
        return LOW + (PEAK - LOW) * max(0.0, (steps - i) / (steps - warmup))
    if kind == "cosine":
        progress = min(1.0, (i - warmup + 1) / (steps - warmup))
        return PEAK * (LOW / PEAK + (1 - LOW / PEAK) * (1 + math.cos(math.pi * progress)) / 2)
    progress = min(1.0, max(0.0, (step - 1 - (steps - decay)) / decay))
    fall = progress if kind == "wsd-linear" else math.sqrt(progress)
    return LOW + (PEAK - LOW) * (1 - fall)


def lr_config(tmp_path) -> str:
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    config["scheduler"]["params"].update(warmup_min_lr=LOW, warmup_max_lr=PEAK,
                                         warmup_num_steps=WARMUP)
    config["optimizer"]["params"]["lr"] = PEAK
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(config))
    return str(path)


def flags(data, tmp_path, *extra):
    return ["--data", data, "--ds-config", lr_config(tmp_path), "--out", str(tmp_path / "run"),
            "--model", "tiny", "--seq-len", "64", *extra]


@pytest.mark.parametrize("kind, extra", [
    ("linear", ["--lr-schedule", "linear"]),
    ("linear", []),  # the config's own scheduler
    ("cosine", ["--lr-schedule", "cosine"]),
    ("wsd-linear", ["--lr-schedule", "wsd", "--decay-steps", "7"]),
    ("wsd-1-sqrt", ["--lr-schedule", "wsd", "--decay-steps", "7", "--decay-shape", "1-sqrt"]),
])
def test_each_schedule_gives_every_step_the_formulas_rate(data, tmp_path, monkeypatch, kind,
                                                          extra):
    """The scheduler DeepSpeed steps (its own class, or ours for wsd) on a real optimizer, from
    the config tupe-pretrain writes; and again from the state a checkpoint keeps, mid-run."""
    steps = 20
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = load(flags(data, tmp_path, "--steps", str(steps), *extra))
    config, client = client_scheduler(run.ds_config)

    def scheduler():
        parameter = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([parameter], lr=run.ds_config["optimizer"]["params"]["lr"])
        if client is not None:
            assert "scheduler" not in config
            return optimizer, client(optimizer)
        kind_class = getattr(lr_schedules, config["scheduler"]["type"])
        return optimizer, kind_class(optimizer, **config["scheduler"]["params"])

    optimizer, stepped = scheduler()
    rates = []
    for step in range(1, steps + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        if step == 11:  # a resume: a new scheduler given the checkpoint's state
            optimizer, resumed = scheduler()
            resumed.load_state_dict(stepped.state_dict())
            stepped = resumed
            for group, lr in zip(optimizer.param_groups, stepped.get_lr()):  # optim.apply_config
                group["lr"] = lr
            rates[-1] = optimizer.param_groups[0]["lr"]
        stepped.step()
    decay = 7 if kind.startswith("wsd") else 0
    assert rates == pytest.approx([expected_lr(kind, s, steps, decay)
                                   for s in range(1, steps + 1)], rel=1e-9, abs=1e-12)
    if kind.startswith("wsd"):  # the peak holds until the decay, which falls every step
        assert rates[steps - decay - 1] == pytest.approx(PEAK)
        assert all(a > b for a, b in zip(rates[steps - decay:], rates[steps - decay + 1:]))


def test_another_shape_keeps_the_configs_peak_minimum_and_warmup(data, tmp_path, monkeypatch):
    """--lr-schedule changes the shape only: a cosine config's end ratio stays with cosine, a
    warmup without a type stays DeepSpeed's log warmup."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    config["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
        "warmup_num_steps": 4}}
    cosine = tmp_path / "cosine.json"
    cosine.write_text(json.dumps(config))
    run = load(flags(data, tmp_path, "--steps", "20", "--lr-schedule", "cosine", "--ds-config",
                     str(cosine)))
    assert run.ds_config["scheduler"]["params"] == {
        "total_num_steps": 20, "warmup_num_steps": 4, "warmup_type": "log",
        "warmup_min_ratio": pytest.approx(0.1), "cos_min_ratio": 0.01}
    run = load(flags(data, tmp_path, "--steps", "20", "--lr-schedule", "wsd", "--decay-steps",
                     "5", "--ds-config", str(cosine)))
    assert run.ds_config["scheduler"]["params"]["warmup_min_lr"] == pytest.approx(
        0.1 * config["optimizer"]["params"]["lr"])


def test_schedule_and_ramp_flags_are_checked_before_any_process_starts(data, tmp_path,
                                                                      monkeypatch, capsys):
    def refusal(*extra, world=2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises((SystemExit, Refused)) as error:  # argparse's, or a check's
            load(flags(data, tmp_path, "--steps", "20", *extra))
        return str(error.value) + capsys.readouterr().err

    assert "--lr-schedule wsd needs --decay-steps N" in refusal("--lr-schedule", "wsd")
    assert "add --lr-schedule wsd" in refusal("--decay-steps", "3")
    assert ("--decay-steps 16 leaves no step at the peak: a warmup of 4 steps reaches it at "
            "step 6 (DeepSpeed's schedulers start 2 steps late), so --steps 20 allows at most "
            "--decay-steps 15") in refusal("--lr-schedule", "wsd", "--decay-steps", "16")
    without = tmp_path / "constant.json"
    without.write_text(json.dumps({k: v for k, v in json.load(open(CPU_CONFIG)).items()
                                   if k != "scheduler"}))
    assert (f"--lr-schedule cosine: {without} gives no warmup (its scheduler's "
            "warmup_num_steps); add --warmup-steps N") in refusal(
        "--lr-schedule", "cosine", "--ds-config", str(without))
    assert "--branch needs --init-from" in refusal("--branch")
    assert "--warmup-steps must be at least 1" in refusal("--warmup-steps", "0")
    ramp = ["--global-batch", "16", "--micro-batch", "2", "--rampup-batch-size"]
    assert "START must be below the global batch 16" in refusal(*ramp, "16", "4", "100")
    assert ("START 6 is not a multiple of micro-batch 2 x 2 data-parallel ranks = 4"
            in refusal(*ramp, "6", "4", "100"))
    assert "INCREMENT 2 is not a multiple" in refusal(*ramp, "4", "2", "100")
    assert "minus START 4 is not a multiple of INCREMENT 8" in refusal(*ramp, "4", "8", "100")
    assert "must each be at least 1" in refusal(*ramp, "4", "4", "0")
    assert "invalid choice: 'step'" in refusal("--lr-schedule", "step")
    assert not os.path.exists(tmp_path / "run")


def test_a_ramp_reads_each_sample_once_in_order_on_every_layout_and_resumes_mid_ramp(data):
    """Megatron's ramp (4 -> 16 by 4 over the first 24 samples), through TrainBatches: steps of
    4, 4, 8, 12, 16, ...; the dp ranks' micro-batches of each step are the step's samples, the
    prefetch thread makes the same ones, and a stream resumed at any step goes on alike."""
    vocab = Vocabulary.from_data_dir(data)
    packed = PackedSentences(os.path.join(data, "train"), 64, vocab.cls, vocab.sep, data)
    samples = MaskedSamples(packed, vocab, BERT_MASKING, 7)
    ramp = RampSettings(4, 4, 24)
    sizes, consumed = [], 0
    for _ in range(8):
        sizes.append(BatchRamp(ramp, 16, 2, 2)(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 8, 12, 16, 16, 16, 16]

    def steps(micro, dp, start=0, count=8, prefetch=0):
        ranks = [TrainBatches(samples, micro, 16 // (micro * dp), rank, dp, consumed=start,
                              prefetch=prefetch, ramp=BatchRamp(ramp, 16, micro, dp))
                 for rank in range(dp)]
        made = [torch.cat([b["input_ids"] for rank in ranks for b in rank.next_step()])
                for _ in range(count)]
        for rank in ranks:
            rank.close()
        return made, ranks[0].consumed

    single, end = steps(4, 1)
    assert [len(step) for step in single] == sizes and end == sum(sizes)
    everything = samples.global_samples(0, sum(sizes))["input_ids"]
    assert torch.equal(torch.cat(single), everything)  # each sample once, in order
    for micro, dp, prefetch in ((2, 2, 0), (1, 4, 2)):
        made, _ = steps(micro, dp, prefetch=prefetch)
        assert all(torch.equal(a, b) for a, b in zip(made, single)), (micro, dp)
    resumed, _ = steps(2, 2, start=sum(sizes[:3]), count=5)  # after step 3, mid-ramp
    assert all(torch.equal(a, b) for a, b in zip(resumed, single[3:]))


@pytest.mark.slow
def test_a_ramped_wsd_run_resumes_mid_ramp_on_another_layout_and_refuses_false_branches(
        data, tmp_path, monkeypatch):
    """A stable WSD run with a ramp (dp 2), resumed after step 2, mid-ramp, with tp 2: every
    logged rate and batch is the formula's, exactly the ramp's samples are consumed, and the
    resumed run ends where the first did. Then the decay branches from its checkpoints that
    cannot be one, and a resume with another ramp, are refused before any process starts
    (test_run_integrity.py trains a branch)."""
    config = lr_config(tmp_path)
    common = ["--ds-config", config, "--lr-schedule", "wsd", "--decay-steps", "2",
              "--warmup-steps", "2",
              "--global-batch", "8", "--micro-batch", "2", "--rampup-batch-size", "4", "4", "8",
              "--save-interval", "2", "--eval-interval", "6", "--dropout", "0"]
    stable = tmp_path / "stable"
    train("torchrun", 2, data, stable, "--steps", "6", *common)
    batches = [4, 4, 8, 8, 8, 8]

    def check_log(out, first, steps, decay, sizes):
        logged = log(out)
        for step in range(first, steps + 1):
            assert logged[step]["train/lr"] == pytest.approx(
                expected_lr("wsd-linear", step, steps, decay, warmup=2), rel=1e-9), (out, step)
            assert logged[step]["train/global_batch"] == sizes[step - 1], (out, step)
        return logged

    first = check_log(stable, 1, 6, 2, batches)
    with open(stable / "run.json") as f:
        assert json.load(f)["rampup_batch_size"] == "4 4 8"
    end_state = torch.load(stable / "checkpoints" / "step6" / "mp_rank_00_model_states.pt",
                           weights_only=False)
    assert end_state["consumed"] == sum(batches)  # exactly the ramp's samples
    with open(stable / "run.json") as f:
        weights = consolidated_state(json.load(f), str(stable / "checkpoints" / "step6"))[1]

    # --out alone (and the new layout): the schedule, ramp and data are the run's, from run.json
    resume = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         free_port(), EXIT_WORKER, "pretrain", "--out", str(stable), "--tp", "2",
         "--resume-from", "step2"], env=environment(), capture_output=True, text=True,
        timeout=400)
    output = resume.stdout
    assert resume.returncode == 0, output[-4000:] + resume.stderr[-4000:]
    assert f"settings the command does not give are the run's, from {stable}/history.jsonl" in output
    assert "ramped up from 4 by 4 over the first 8 samples" in output
    resumed = check_log(stable, 3, 6, 2, batches)
    for step in range(3, 7):
        assert resumed[step]["train/loss"] == pytest.approx(first[step]["train/loss"], rel=1e-5)
    with open(stable / "run.json") as f:
        again = consolidated_state(json.load(f), str(stable / "checkpoints" / "step6"))[1]
    for name, tensor in weights.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-5, msg=name)

    step4 = str(stable / "checkpoints" / "step4")
    branch_flags = [*common[:common.index("--decay-steps")], "--decay-steps", "3",
                    *common[common.index("--decay-steps") + 2:], "--tp", "2"]

    def refusal(out, *extra, checkpoint=step4):
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(Refused) as error:
            load(["--data", data, "--model", "tiny", "--seq-len", "64", "--out", str(out),
                  *extra, "--init-from", checkpoint, "--branch"])
        return str(error.value)

    said = refusal(tmp_path / "b2", "--steps", "8", *branch_flags,
                   checkpoint=str(stable / "checkpoints" / "step6"))
    assert "starts the decay at step 5, before the checkpoint's; use --steps 9" in said
    step6 = str(stable / "checkpoints" / "step6")  # the end of the decay: its rate the lowest
    said = refusal(tmp_path / "b5", "--steps", "9", *branch_flags, checkpoint=step6)
    first, last = (expected_lr("wsd-linear", step, steps, decay, warmup=2)
                   for step, steps, decay in ((7, 9, 3), (6, 6, 2)))
    assert (f"--branch from step 6: its last step ran at learning rate {last:.4g}, this "
            f"schedule's first (step 7) at {first:.4g}: the rate would warm back up") in said
    allowed = load(["--data", data, "--model", "tiny", "--seq-len", "64", "--out",
                    str(tmp_path / "b5"), "--steps", "9", *branch_flags, "--init-from", step6,
                    "--branch", "--allow-training-changes"])
    assert any("its last step ran at learning rate" in line for line in allowed.init_plan.changes)
    said = refusal(tmp_path / "b3", "--steps", "7", *branch_flags, "--mask-rate", "0.3")
    assert "--branch:" in said and "masking.probability: 0.15 in the checkpoint, 0.3 now" in said
    said = refusal(tmp_path / "b4", "--steps", "7", *branch_flags[:-2])  # dp 2, not tp 2
    assert "written with --tp 2 --pp 1; its weights load with the same --tp and --pp" in said
    assert not any(os.path.exists(tmp_path / name) for name in ("b2", "b3", "b4", "b5"))
    said = refusal(stable, "--steps", "7", *branch_flags)  # --out forgotten: the stable run's
    assert f"--branch: --out {stable} holds checkpoints of a run that is not a branch" in said
    monkeypatch.setenv("WORLD_SIZE", "2")
    other_ramp = [*common[:common.index("--rampup-batch-size") + 3], "16",
                  *common[common.index("--rampup-batch-size") + 4:]]
    with pytest.raises(Refused) as error:  # a resume with another ramp
        load(["--data", data, "--model", "tiny", "--seq-len", "64", "--out", str(stable),
              "--steps", "8", *other_ramp, "--tp", "2", "--allow-training-changes"])
    assert "rampup_batch_size: '4 4 8' in the checkpoint, '4 4 16' now (--rampup-batch-size)" \
        in str(error.value)
