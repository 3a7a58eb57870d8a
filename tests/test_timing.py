"""Where a run's time goes (tupe_ds/train/monitor.py): each logged interval is timed from its
first step, evaluation and saves are kept out of the training seconds, and the cumulative
training seconds survive resumes; tupe-compare's time axis reads them (compare/results.py)."""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runs import CPU_CONFIG, ROOT, environment, log
from tupe_ds.compare.results import training_time
from tupe_ds.model.config import ModelConfig
from tupe_ds.train import monitor as monitor_module

FAULT_WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_an_interval_counts_its_steps_and_not_evaluation_or_saves(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(monitor_module.time, "perf_counter", clock)
    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32,
                         vocab_size=16)
    monitor = monitor_module.Monitor(str(tmp_path), (config,), 8, 1, 0, resumed_at=100,
                                     times={"training": 50.0, "evaluation": 3.0,
                                            "checkpoint": 1.0})
    clock.now = 30.0  # start-up: not the first interval's
    monitor.start()
    clock.now = 34.0
    with monitor.timing("evaluation"):
        clock.now = 39.0
    with monitor.timing("checkpoint"):
        clock.now = 41.0
    clock.now = 47.0  # 10 s of training in steps 101-110
    monitor.train(110, {"loss": 1.0}, 1e-3, None, None, 0, samples=40, global_batch=4,
                  tokens_seen=300)
    first = log(str(tmp_path))[110]
    assert first["throughput/seconds_per_step"] == pytest.approx(1.0)
    assert first["throughput/samples_per_s"] == pytest.approx(4.0)
    assert first["throughput/tokens_per_s"] == pytest.approx(30.0)  # real tokens, not 40 x 8
    assert first["train/tokens_seen"] == 300
    assert first["time/training_seconds"] == pytest.approx(60.0)
    # evaluation's and saves' seconds are logged where they change (one point a step), and a
    # checkpoint carries them
    assert not {"time/evaluation_seconds", "time/checkpoint_seconds"} & set(first)
    assert monitor.times()["evaluation"] == pytest.approx(8.0)
    assert monitor.times()["checkpoint"] == pytest.approx(3.0)
    assert first["time/startup_seconds"] > 0
    clock.now = 49.0
    assert monitor.times()["training"] == pytest.approx(62.0)  # a save now carries this
    clock.now = 67.0
    monitor.train(120, {"loss": 1.0}, 1e-3, None, None, 0, samples=80, global_batch=8,
                  tokens_seen=900)
    second = log(str(tmp_path))[120]
    assert second["throughput/tokens_per_s"] == pytest.approx(30.0)  # 600 in 20 s
    assert second["throughput/seconds_per_step"] == pytest.approx(2.0)
    assert (second["throughput/samples_per_s"], second["train/global_batch"]) == (4.0, 8)
    assert second["time/training_seconds"] == pytest.approx(80.0)
    assert "time/startup_seconds" not in second  # once per start


def test_the_time_axis_reads_the_training_seconds_or_estimates_an_older_log_s(tmp_path):
    """An earlier tupe_ds's log has seconds_per_step only, its first line after each start
    wrong by the start-up: estimated by their median, also where a run of this one resumed it
    (from a checkpoint without times: the Monitor starts from the same estimate)."""
    logged = {2: {"throughput/seconds_per_step": 9.0, "time/training_seconds": 1.0},
              4: {"throughput/seconds_per_step": 0.5, "time/training_seconds": 2.0}}
    assert training_time(logged) == ([2, 4], [1.0, 2.0])
    older = {2: {"throughput/seconds_per_step": 9.0}, 4: {"throughput/seconds_per_step": 0.5},
             6: {"throughput/seconds_per_step": 0.6}}
    assert training_time(older) == ([2, 4, 6], [pytest.approx(1.2), pytest.approx(2.4),
                                                pytest.approx(3.6)])
    log_path = tmp_path / "train_log.jsonl"
    log_path.write_text("".join(json.dumps({"step": step, **e}) + "\n"
                                for step, e in older.items()))
    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32,
                         vocab_size=16)
    monitor = monitor_module.Monitor(str(tmp_path), (config,), 8, 1, 0, resumed_at=6)
    assert monitor.seconds["training"] == pytest.approx(3.6)  # 6 steps x the median 0.6
    mixed = {**older, 8: {"time/training_seconds": 4.8}}
    assert training_time(mixed)[1][-2:] == [pytest.approx(3.6), 4.8]


@pytest.mark.slow
def test_a_run_resumed_twice_records_the_training_time_its_steps_took(data, tmp_path):
    """12 steps, stopped by SIGUSR1 in steps 4 and 8 (it saves and exits) and run again: the
    recorded training seconds equal a clock outside the run (each start's first to last step)
    within 10%, and each start's first interval is timed from its first step: its 2 steps take
    less than half the start-up before them, which a clock started with the process would
    count in (a bound a busy machine slows alike on both sides: CI saw a first interval 3.5x
    the steady ones' while another test loaded the cores)."""
    out, stamps = tmp_path / "run", tmp_path / "stamps"
    for fault, said in (("usr1:0:4", "stopping at step 4"), ("usr1:0:8", "resumed at step 4"),
                        ("", "resumed at step 8")):
        result = subprocess.run(
            [sys.executable, FAULT_WORKER, "pretrain", "--data", data, "--model", "tiny",
             "--ds-config", CPU_CONFIG, "--out", str(out), "--seq-len", "64",
             "--steps", "12", "--log-interval", "2", "--save-interval", "100",
             "--eval-interval", "100", "--eval-samples", "32"],
            env={**environment(), "TUPE_DS_FAULT": ";".join(filter(None, [fault,
                                                                            f"stamp:{stamps}"]))},
            capture_output=True, text=True, timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 0 and said in output, output[-4000:]
    entries = log(out)
    rows = [line.split() for line in stamps.read_text().splitlines()]
    starts = {int(step): float(start) for step, start, _ in rows}
    ends = {int(step): float(end) for step, _, end in rows}
    outside = sum(ends[last] - starts[first] for first, last in ((1, 4), (5, 8), (9, 12)))
    recorded = entries[12]["time/training_seconds"]
    assert recorded == pytest.approx(outside, rel=0.1)
    per_step = {step: e["throughput/seconds_per_step"] for step, e in entries.items()
                if "throughput/seconds_per_step" in e}
    for first in (2, 6, 10):  # each start's first interval, of 2 steps
        startup = entries[first]["time/startup_seconds"]
        assert 0 < 2 * per_step[first] < startup / 2, (per_step, startup)
    assert entries[12]["time/evaluation_seconds"] > 0
    assert entries[12]["time/checkpoint_seconds"] > 0  # the saves at steps 4 and 8, carried
    # the run's elapsed time goes on over its starts; each series has one point a step
    elapsed = [entries[step]["time/elapsed_seconds"] for step in (2, 4, 6, 8, 10, 12)]
    assert elapsed == sorted(elapsed)
    seen = [entries[step]["train/tokens_seen"] for step in (2, 4, 6, 8, 10, 12)]
    assert seen == sorted(seen) and len(set(seen)) == 6  # carried over the resumes
    assert elapsed[2] > elapsed[1] + entries[6]["time/startup_seconds"] / 2  # and its start-up
    events = EventAccumulator(str(out / "tensorboard" / "tupe")).Reload()
    for tag in events.Tags()["scalars"]:
        steps = [event.step for event in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert [e.step for e in events.Scalars("time/checkpoint_seconds")] == [4, 8, 12]


@pytest.mark.slow
def test_a_stop_after_a_validation_says_that_validation_s_step(data, tmp_path):
    """SIGUSR1 in step 5, the last validation at step 3: the summary names step 3, not 5."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, FAULT_WORKER, "pretrain", "--data", data, "--model", "tiny", "--ds-config",
         CPU_CONFIG, "--out", str(out), "--seq-len", "64", "--steps", "8", "--log-interval", "1",
         "--eval-interval", "3", "--eval-samples", "32"],
        env={**environment(), "TUPE_DS_FAULT": "usr1:0:5"}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0 and "stopping at step 5" in result.stdout, result.stdout[-4000:]
    assert f"final valid loss {log(out)[3]['valid/loss']:.4f} at step 3\n" in result.stdout
