"""A run whose folder another job took over writes nothing more (tupe_ds/train/run_folder/lock.py):
real one-process tupe-pretrain runs as typed (no launcher), the take-over made by
tests/support/takeover_worker.py as after this run was presumed gone."""

import glob
import json
import os
import subprocess
import sys

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runs import CPU_CONFIG, ROOT, environment
from tupe_ds.train.checkpoint import manifest

TAKEOVER_WORKER = os.path.join(ROOT, "tests", "support", "takeover_worker.py")
STOPPED = ("tupe-pretrain: this run no longer holds its run folder ({out}/run.lock now names "
           "process 4242 on node-elsewhere, started 2026-11-26T00:00:00+00:00): another job took "
           "it over (this one was presumed gone); stopping without saving")


def taken_over(data, out, when):
    """The output of a run of 6 steps (saves every 2, one kept) taken over `when`; it must stop
    with exit code 3."""
    command = [sys.executable, TAKEOVER_WORKER, "pretrain", "--data", data, "--model", "tiny",
               "--ds-config", CPU_CONFIG, "--out", str(out), "--seq-len", "64",
               "--log-interval", "1", "--eval-samples", "32", "--steps", "6",
               "--save-interval", "2", "--eval-interval", "6", "--keep-checkpoints", "1"]
    result = subprocess.run(command, env={**environment(), "TUPE_DS_TAKE_OVER": when},
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-4000:]
    assert STOPPED.format(out=out) in output, output[-4000:]
    assert json.loads((out / "run.lock").read_text())["token"] == "another job"  # left alone
    return output


def logged(out):
    """(the steps of train_log.jsonl's entries, those of its training lines)"""
    entries = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return ({e["step"] for e in entries}, [e["step"] for e in entries if "train/loss" in e])


def steps_in(checkpoints):
    return sorted(name for name in os.listdir(checkpoints) if name.startswith("step"))


def deepspeed_events(out):
    """The steps of the events DeepSpeed's own monitor wrote (its `step` counts samples)."""
    steps = set()
    for path in glob.glob(str(out / "tensorboard" / "**" / "events.out.tfevents.*"),
                          recursive=True):
        if os.sep + "deepspeed" in path:
            accumulator = EventAccumulator(path)
            accumulator.Reload()
            steps |= {e.step for tag in accumulator.Tags()["scalars"]
                      for e in accumulator.Scalars(tag)}
    return steps


@pytest.mark.slow
def test_a_run_taken_over_mid_run_stops_before_its_next_log_line(data, tmp_path):
    out = tmp_path / "run"
    taken_over(data, out, "step:3")
    assert logged(out) == ({1, 2}, [1, 2])
    assert steps_in(out / "checkpoints") == ["step2"]
    samples_per_step = json.loads((out / "run.json").read_text())["global_batch"]
    assert deepspeed_events(out) and max(deepspeed_events(out)) <= 2 * samples_per_step


@pytest.mark.slow
def test_a_run_taken_over_mid_save_commits_nothing(data, tmp_path):
    """Taken over once the files of step4 are written, before its manifest: no manifest, `latest`
    still at step2, and retention (one checkpoint kept) has not removed step2."""
    out = tmp_path / "run"
    taken_over(data, out, "save:4")
    checkpoints = out / "checkpoints"
    assert not manifest.exists(str(checkpoints / "step4"))
    assert manifest.exists(str(checkpoints / "step2"))
    assert (checkpoints / "latest").read_text().strip() == "step2"
    assert logged(out) == ({1, 2, 3, 4}, [1, 2, 3, 4])
