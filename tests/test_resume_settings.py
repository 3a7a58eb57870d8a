"""What a resume takes, checked before any process starts (config.load): the settings the run
recorded fill every one the command does not give, retyped required flags or not, and the start
line names them and those given anew; a longer --steps that moves the rate of the next step (a
decay's end, a warmup cut to --steps) is refused with both rates, or taken with
--allow-training-changes and said; one whose rate goes on proceeds unsaid."""

import json
import os
import shutil
import subprocess

import pytest

from runs import CPU_CONFIG, command, environment, log, train
from tupe_ds.tools.errors import Refused
from tupe_ds.train.config import load
from tupe_ds.train.schedule import WSD_TYPE, resume_rate_change

PEAK, WARMUP = 1e-3, 5  # cpu_zero2.json's WarmupDecayLR, from 0


def decay_rate(step: int, steps: int) -> float:
    """WarmupDecayLR's rate of step `step` (from 1) of a run of `steps`, past its warmup."""
    return PEAK * (steps - (step - 2)) / (steps - WARMUP)


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A run of 30 steps under a linear decay, saved every 15: run.json records its settings.
    (This file's runs are one process without a launcher: no test here is about one.)"""
    out = tmp_path_factory.mktemp("decay") / "run"
    train(None, 1, data, out, "--steps", "30", "--save-interval", "15",
          "--warmup-steps", str(WARMUP), "--eval-interval", "30")
    return out


@pytest.fixture
def run(finished, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    shutil.copytree(finished, tmp_path / "run")
    return str(tmp_path / "run")


@pytest.mark.slow
def test_retyped_required_flags_keep_the_recorded_settings(run, data, capsys):
    """--data, --ds-config and --steps given: the run's --save-interval, --model, --seq-len and
    --warmup-steps still fill the rest (a command complete on its own took the defaults)."""
    resumed = load(["--out", run, "--data", data, "--ds-config", CPU_CONFIG, "--steps", "30",
                    "--check-only"])
    assert resumed.intervals.save == 15 and resumed.model == "tiny" and resumed.seq_len == 64
    assert resumed.ds_config["scheduler"]["params"]["warmup_num_steps"] == WARMUP
    said = capsys.readouterr().out
    assert (f"the settings the command does not give are the run's, from {run}/history.jsonl: "
            in said)
    assert "--model" in said and "--save-interval" in said and "--data," not in said
    assert "given anew" not in said  # the same values retyped


def test_a_setting_given_anew_is_named_old_to_new(run, capsys):
    resumed = load(["--out", run, "--steps", "30", "--save-interval", "10", "--check-only"])
    assert resumed.intervals.save == 10
    said = capsys.readouterr().out
    assert "; given anew, other than the run's: --save-interval 15 -> 10 (--print-config" in said


def test_a_longer_steps_that_moves_the_decay_is_refused_with_both_rates(run, monkeypatch):
    with pytest.raises(Refused) as refusal:
        load(["--out", run, "--steps", "40"])
    assert str(refusal.value) == (
        f"resuming step30 with --steps 40: step 31 would run at learning "
        f"rate {decay_rate(31, 40):.4g}, not the {decay_rate(31, 30):.4g} of the schedule step 30 "
        "ran under. Resume with --steps 30 to keep that schedule, or add "
        "--allow-training-changes to go on with this one")
    assert load(["--out", run, "--steps", "30"]).resume_plan.notes == ()  # the same schedule


def test_check_only_on_a_finished_run_says_a_run_would_train_nothing(run, capsys):
    from tupe_ds.pretrain import run_or_check

    assert run_or_check(load(["--out", run, "--check-only"]), "torchrun") == 0
    said = capsys.readouterr().out
    assert "tupe-pretrain: step30 is at --steps 30: resuming it, a run would train nothing and " \
        "say the run's summary (a larger --steps trains on)" in said


@pytest.mark.slow
def test_a_moved_rate_allowed_is_said_and_trained(run, data):
    """And a fallback to a checkpoint of the old schedule is checked as a first choice is: step32
    damaged, the same --steps 32 falls back to step30, refused with both rates (it trained on
    unsaid); with --allow-training-changes, said."""
    said = train(None, 1, data, run, "--steps", "32", "--allow-training-changes")
    moved = (f"resuming step30 with --steps 32: step 31 would run at learning rate "
             f"{decay_rate(31, 32):.4g}, not the {decay_rate(31, 30):.4g}")
    assert moved.replace(":", " (--allow-training-changes):", 1) in said
    assert log(run)[31]["train/lr"] == pytest.approx(decay_rate(31, 32), rel=1e-9)
    states = os.path.join(run, "checkpoints", "step32", "mp_rank_00_model_states.pt")
    with open(states, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    refused = subprocess.run(command(None, 1, data, run, "--steps", "32"), env=environment(),
                             capture_output=True, text=True, timeout=400)
    assert refused.returncode == 2 and f"tupe-pretrain: error: {moved}" in refused.stderr, \
        refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "failed verification" in refused.stdout  # and step32 set aside, as damage is
    said = train(None, 1, data, run, "--steps", "32", "--allow-training-changes")
    assert moved.replace(":", " (--allow-training-changes):", 1) in said


@pytest.mark.slow
def test_a_longer_steps_at_a_constant_rate_proceeds_unsaid(data, tmp_path, monkeypatch, capsys):
    with open(CPU_CONFIG) as f:
        config = {k: v for k, v in json.load(f).items() if k != "scheduler"}
    constant = tmp_path / "constant.json"
    constant.write_text(json.dumps(config))
    out = str(tmp_path / "run")
    train(None, 1, data, out, "--steps", "2", "--ds-config", str(constant))
    monkeypatch.setenv("WORLD_SIZE", "1")
    resumed = load(["--out", out, "--steps", "6", "--check-only"])
    assert resumed.resume_plan.tag == "step2" and resumed.resume_plan.notes == ()
    assert "given anew, other than the run's: --steps 2 -> 6" in capsys.readouterr().out


def wsd(steps: int, decay: int) -> dict:
    return {"type": WSD_TYPE, "params": {
        "total_num_steps": steps, "decay_num_steps": decay, "decay_shape": "linear",
        "warmup_min_lr": 0.0, "warmup_max_lr": PEAK, "warmup_num_steps": 2,
        "warmup_type": "linear"}}


def test_wsd_goes_on_in_its_stable_phase_and_says_a_decay_begun_again():
    """--steps 10 -> 20 with 2 decay steps: from step 8 (stable) the rate goes on; from step 9
    (in the decay that began after step 8) it would climb back to the peak."""
    assert resume_rate_change(wsd(10, 2), 8, wsd(20, 2)) == ""
    assert resume_rate_change(None, 8, None) == ""  # a constant rate
    assert resume_rate_change(wsd(10, 2), 9, wsd(20, 2)) == (
        f"step 10 would run at learning rate {PEAK:.4g}, not the {PEAK / 2:.4g} of the schedule "
        "step 9 ran under: its decay began after step 8, this one begins after step 18, and the "
        "rate goes back to the peak until then")
    slower = resume_rate_change(wsd(10, 2), 9, wsd(20, 12))  # decaying on, over more steps
    assert slower.startswith("step 10 would run at learning rate") and "peak" not in slower


@pytest.mark.slow
def test_a_finished_run_run_again_says_its_summary_without_building_an_engine(run, data):
    """The same command again on a run at its --steps: its summary from the log, the final
    validation the logged one, and no engine built (no new TensorBoard events file: a Monitor
    opens one at every start)."""
    log_dir = os.path.join(run, "tensorboard", "tupe")
    events = sorted(os.listdir(log_dir))
    said = train(None, 1, data, run, "--steps", "30")
    assert "resumed at step 30 of 30: nothing to train" in said, said[-3000:]
    assert f"final valid loss {log(run)[30]['valid/loss']:.4f} at step 30\n" in said
    assert "this start trained no step of 30" in said
    assert sorted(os.listdir(log_dir)) == events
