"""The progress line, its ETA and MFU, and the summary at the end of a start
(tupe_ds/train/progress.py, Monitor.train and Monitor.summary); a real run's lines:
test_pretrain.py, test_loss_falls_and_tensorboard_has_the_run."""

import json
import math
import re

import pytest
import torch

import runs
from runs import log
from terminal import on_a_terminal
from tupe_ds.model.config import ModelConfig
from tupe_ds.train import monitor as monitor_module
from tupe_ds.train import progress

CONFIG = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32,
                     vocab_size=16)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "fp16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA H100 80GB HBM3", "fp32", None), ("NVIDIA GeForce RTX 4090", "bf16", None)])
def test_the_mfu_is_against_the_device_s_peak_for_the_run_s_precision(name, precision, peak):
    mfu = progress.mfu_percent(123.4, name, precision)
    if peak is None:
        assert mfu is None
        assert name in progress.no_mfu_note(name, precision)
    else:
        assert mfu == pytest.approx(100 * 123.4 / peak)


def test_the_eta_after_a_resume_counts_the_steps_left_at_the_recent_pace(tmp_path, monkeypatch):
    """Resumed at step 100 of 130 on the CPU: the line says step/130 and no GPU figure, the ETA
    counts the 20 and then 10 steps left, at the recent intervals' seconds a step with this
    start's evaluation spread over its steps."""
    clock = Clock()
    monkeypatch.setattr(monitor_module.time, "perf_counter", clock)
    monitor = monitor_module.Monitor(str(tmp_path), (CONFIG,), 8, 1, 0, resumed_at=100,
                                     steps=130, device=torch.device("cpu"))
    monitor.start()
    clock.now = 10.0  # steps 101-110: 1 s a step
    line = str(monitor.train(110, {"loss": 2.0}, 1e-3, 0.5, None, 0, samples=40, global_batch=4,
                             tokens_seen=300))
    assert log(str(tmp_path))[110]["time/eta_seconds"] == pytest.approx(20.0)
    assert line.startswith("step 110/130 | loss 2.0000 | lr 1.000e-03 | grad norm 0.500 | "
                           "1000 ms/step | 30 tokens/s | ")
    assert line.endswith(" | ETA 0:00:20 | skipped 0")
    assert "TFLOPS" not in line and "memory" not in line and "MFU" not in line
    with monitor.timing("evaluation"):
        clock.now = 15.0
    clock.now = 35.0  # steps 111-120: 2 s a step
    line = str(monitor.train(120, {"loss": 2.0}, 1e-3, None, None, 0, samples=40, global_batch=4,
                             tokens_seen=600))
    entry = log(str(tmp_path))[120]
    # (10 + 20 s) / 20 steps, and 5 s of evaluation over the 20 steps: 1.75 s for each of 10
    assert entry["time/eta_seconds"] == pytest.approx(17.5)
    assert "ETA 0:00:18" in line and "grad norm" not in line
    assert entry["train/skipped_steps"] == 0 and entry["time/elapsed_seconds"] > 0
    assert not {"throughput/mfu_percent", "memory/max_allocated_gib"} & set(entry)


def test_the_eta_forgets_a_slow_start_after_a_window_of_intervals():
    eta = progress.Eta()
    eta.add(1, 100.0, 0.0)  # a first step that warms up
    eta.add(10, 10.0, 0.0)
    assert eta.seconds(50) == pytest.approx(50 * 110 / 11)
    for _ in range(progress.Eta.WINDOW - 1):
        eta.add(10, 10.0, 0.0)
    assert eta.seconds(50) == pytest.approx(50.0)


CPU_VALUES = {"train/loss": 7.12346, "train/lr": 1e-3, "train/grad_norm": 1.23456,
              "throughput/seconds_per_step": 0.15234, "throughput/samples_per_s": 105.27,
              "throughput/tokens_per_s": 53898.2, "throughput/tokens_per_s_per_gpu": 26949.1,
              "throughput/tflops_per_rank": 123.456, "train/tokens_seen": 1_234_567_890,
              "train/skipped_steps": 0, "train/nonfinite_steps": 0,
              "time/elapsed_seconds": 3725.4, "time/eta_seconds": 90061.0}
GPU_VALUES = {**CPU_VALUES, "train/loss_scale": 65536.0, "throughput/mfu_percent": 12.48,
              "memory/max_allocated_gib": 3.2, "memory/max_reserved_gib": 4.0,
              "train/skipped_steps": 7, "train/nonfinite_steps": 1}


def test_the_line_has_the_gpu_s_figures_where_it_has_its_memory():
    assert str(progress.line(20, 1000, CPU_VALUES)) == (
        "step   20/1000 | loss 7.1235 | lr 1.000e-03 | grad norm 1.235 | 152 ms/step | "
        "53.9k tokens/s | 26.9k tokens/s/GPU | 105.3 samples/s | 1.23B tokens seen | "
        "elapsed 1:02:05 | ETA 25:01:01 | skipped 0")
    assert str(progress.line(1000, 1000, GPU_VALUES)) == (
        "step 1000/1000 | loss 7.1235 | lr 1.000e-03 | grad norm 1.235 | loss scale 65536 | "
        "152 ms/step | 53.9k tokens/s | 26.9k tokens/s/GPU | 105.3 samples/s | "
        "123.5 TFLOPS/GPU | MFU 12.5% | memory 3.20 GiB (4.00 reserved) | 1.23B tokens seen | "
        "elapsed 1:02:05 | ETA 25:01:01 | skipped 7 (1 not finite)")
    unknown_peak = {name: value for name, value in GPU_VALUES.items()
                    if name != "throughput/mfu_percent"}
    assert "MFU" not in str(progress.line(1000, 1000, unknown_peak))


@pytest.mark.parametrize("values", [CPU_VALUES, GPU_VALUES], ids=["cpu", "gpu"])
def test_on_a_narrow_terminal_the_line_keeps_its_most_important_fields(values):
    line = progress.line(20, 1000, values)
    at_80 = line.fit(80)
    assert len(at_80) <= 80 and at_80.startswith("step   20/1000 | loss 7.1235 | ")
    assert "ETA 25:01:01" in at_80
    assert ("ms/step" in at_80 if values is CPU_VALUES  # the skipped steps go before it
            else at_80.endswith(" | skipped 7 (1 not finite)"))
    fields = str(line).split(" | ")
    kept = at_80.split(" | ")
    assert kept == [field for field in fields if field in kept]  # the same order
    assert (line.fit(40) == "step   20/1000 | loss 7.1235" if values is CPU_VALUES
            else line.fit(45) == "step   20/1000 | skipped 7 (1 not finite)")
    assert line.fit(10) == "step   20/1000"  # the step stays, however narrow
    assert line.fit(1000) == str(line)


def test_the_summary_says_the_run_s_best_validation_and_where_things_are(tmp_path):
    """Resumed at step 30 of 40: the best validation of every start, from the log (the earliest
    of equal ones), or the last one, measured after the log's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text("".join(
        json.dumps({"step": step, "valid/loss": loss}) + "\n"
        for step, loss in ((10, 5.0), (20, 4.5), (25, 4.5), (30, 4.7))))
    monitor = monitor_module.Monitor(str(out), (CONFIG,), 8, 1, 0, resumed_at=30, steps=40,
                                     times={"training": 3600.0})
    monitor.close()
    lines = monitor.summary(40, 40, 4.6, "step40").split("\n")
    assert lines[0] == "final valid loss 4.6000 at step 40"
    assert re.fullmatch(r"this start trained steps 31-40 of 40 in \d+:\d\d:\d\d \(wall time since "
                        r"its process started\); the run's training time 1:00:00", lines[1])
    assert lines[1].endswith("; the run's training time 1:00:00")
    assert lines[2:] == ["best valid loss 4.5000 at step 20",
                         f"newest checkpoint {out}/checkpoints/step40",
                         f"log {out}/train_log.jsonl",
                         f"tensorboard --logdir {out}/tensorboard"]
    assert "best valid loss 4.4000 at step 40" in monitor.summary(40, 40, 4.4, None)
    assert "newest checkpoint none written" in monitor.summary(40, 40, 4.4, None)
    assert "best valid loss 4.5000 at step 20" in monitor.summary(40, 40, math.nan, None)
    (out / "train_log.jsonl").write_text(json.dumps({"step": 10, "valid/loss": math.nan}) + "\n")
    assert "best valid loss 4.6000 at step 40" in monitor.summary(40, 40, 4.6, None)
    assert "best valid loss nan at step 10" in monitor.summary(40, 40, math.nan, None)
    stopped = monitor.summary(41, 40, 4.6, "step41").split("\n")  # SIGTERM after step 41
    assert stopped[0] == "final valid loss 4.6000 at step 40"
    assert stopped[1].startswith("this start trained steps 31-41 of 40 in ")
    other_rank = monitor_module.Monitor(str(out), (CONFIG,), 8, 2, 1, resumed_at=30, steps=40)
    assert other_rank.summary(40, 40, 4.6, "step40") == ""


@pytest.mark.slow
def test_on_an_80_column_terminal_the_progress_line_fits_and_the_log_keeps_it_whole(data,
                                                                                  tmp_path):
    """A run at a terminal of 80 columns: each progress line fits, with the step, the loss, the
    ETA and ms per step; the same run's train_log.jsonl holds every field (a Slurm log, a file,
    gets the whole line: test_pretrain.py)."""
    out = tmp_path / "run"
    shown = on_a_terminal(runs.command(None, 1, data, out, "--steps", "3"), 80,
                          runs.environment())
    lines = [line for line in shown.splitlines() if line.startswith("step ") and " | " in line]
    assert len(lines) == 3, shown[-3000:]
    for line in lines:
        assert len(line) <= 80, line
        assert re.match(r"step [0-9]/3 \| loss [0-9.]+ \| .*ms/step.* \| ETA [0-9:]+", line), line
    logged = log(str(out))[3]
    assert {"train/tokens_seen", "throughput/tokens_per_s_per_gpu",
            "throughput/data_loading_percent"} <= set(logged)


def test_counts_are_short_and_never_in_scientific_notation():
    assert [progress.count(n) for n in (950, 999.4, 999.5, 53898.2, 999_499, 999_600,
                                        999_999_999, 1.234e12)] == [
        "950", "999", "1k", "53.9k", "999k", "1M", "1B", "1234B"]
