"""tupe-compare: a real tiny comparison under the deepspeed launcher (killed midway, resumed,
re-run), its report against the runs' own logs, a failing run among others, the plan's checks,
and the report's arithmetic. The Slurm array is in test_slurm.py."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from test_pretrain import CPU_CONFIG, environment, log
from tupe_ds.compare import cli, results, runner
from tupe_ds.compare.plan import Plan, Run, read_plan

TINY = ["--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64", "--log-interval", "2",
        "--eval-samples", "32", "--lr", "2e-3", "--warmup-steps", "2"]


def compare_command(data, out, *flags):
    return [sys.executable, "-m", "tupe_ds.compare.cli", "run", "--data", data, "--out", str(out),
            *TINY, *flags]


def png_size(path) -> tuple:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path}: not a PNG"
    return struct.unpack(">II", head[16:24])


def latest_step(run_dir) -> int:
    path = os.path.join(run_dir, "checkpoints", "latest")
    return int(open(path).read().strip()[len("step"):]) if os.path.exists(path) else 0


def first_validated_at_or_below(logged: dict, loss: float):
    """The first step of a run's log whose validation loss is at most `loss` (None: none is)."""
    return next((step for step, entry in sorted(logged.items())
                 if entry.get("valid/loss", float("inf")) <= loss), None)


def test_a_killed_comparison_resumes_reports_the_logs_numbers_and_reruns_nothing(data, tmp_path):
    out = tmp_path / "cmp"
    command = compare_command(data, out, "--encodings", "bert-a,tupe-r", "--steps", "40",
                              "--nproc", "2", "--eval-interval", "10", "--save-interval", "5")
    first = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while latest_step(out / "runs" / "bert-a-seed1") < 5:
        assert first.poll() is None and time.time() < deadline, first.stdout.read()[-3000:]
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # the runner, its launcher and both ranks
    first.wait()
    killed_at = latest_step(out / "runs" / "bert-a-seed1")
    assert killed_at < 40

    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_log = (out / "logs" / "bert-a-seed1.log").read_text()
    assert f"resumed at step {killed_at} of 40" in run_log

    made = json.loads((out / "report.json").read_text())
    assert [r["state"] for r in made["runs"]] == ["complete", "complete"]
    race = made["race"]
    baseline_log = log(out / "runs" / "bert-a-seed1")
    target = baseline_log[40]["valid/loss"]  # the race is to the baseline's final loss
    early = baseline_log[20]["valid/loss"]  # a loss bert-a reaches before its last validation
    assert race["baseline"] == "bert-a" and race["target"] == target
    base_seconds = made["runs"][0]["valid"]["seconds"][-1]
    for record in made["runs"]:
        logged = log(out / "runs" / record["name"])
        valid_steps = [step for step, entry in logged.items() if "valid/loss" in entry]
        assert valid_steps == [10, 20, 30, 40] == record["valid"]["step"]
        assert record["valid"]["loss"] == [logged[s]["valid/loss"] for s in valid_steps]
        assert record["final_valid_loss"] == logged[40]["valid/loss"]
        description = json.loads((out / "runs" / record["name"] / "run.json").read_text())
        flops = description["flops_per_step"]
        assert record["valid"]["flops"] == [s * flops for s in valid_steps]
        assert 0 < record["valid"]["seconds"][0] < record["valid"]["seconds"][-1]
        step = first_validated_at_or_below(logged, target)
        seconds = None if step is None else record["valid"]["seconds"][valid_steps.index(step)]
        assert race["encodings"][record["encoding"]] == {
            "step": step, "seconds": seconds,
            "share_of_baseline_steps": None if step is None else step / 40,
            "share_of_baseline_time": None if step is None else seconds / base_seconds}
        assert results.first_reaching(made["curves"][record["encoding"]], early)[0] == \
            first_validated_at_or_below(logged, early)  # the first step at or below, not the last
    assert made["curves"]["tupe-r"]["mean"] == made["runs"][1]["valid"]["loss"]  # one seed
    assert list(made["positional"]) == ["tupe-r"]  # bert-a has no content-free positional logits
    cls_row = made["positional"]["tupe-r"]["cls_row"]
    assert len(cls_row) == 4 and len(cls_row[0]) == 64  # tiny: 4 heads, positions 0..63
    width, height = png_size(out / made["figures"]["valid_loss"])
    assert width >= 800 and height >= 300
    width, height = png_size(out / made["positional"]["tupe-r"]["figure"])
    assert width >= 500 and height >= 500
    markdown = (out / "report.md").read_text()
    assert "| bert-a-seed1 | complete | 40 |" in markdown and "![tupe-r]" in markdown

    logs = {name: (out / "runs" / name / "train_log.jsonl").read_bytes()
            for name in ("bert-a-seed1", "tupe-r-seed1")}
    exported = (out / "exports" / "tupe-r-seed1" / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("not started again") == 2
    assert {name: (out / "runs" / name / "train_log.jsonl").read_bytes() for name in logs} == logs
    assert (out / "exports" / "tupe-r-seed1" / "model.safetensors").stat().st_mtime_ns == exported
    assert json.loads((out / "report.json").read_text()) == made


def fake_launch(failing: str):
    """runner.launch_command for tests: the run of `failing` exits 3; any other run writes what a
    finished tupe-pretrain leaves (run.json, train_log.jsonl, checkpoints/latest)."""
    def command(plan, run, launcher):
        if run.encoding == failing:
            return [sys.executable, "-c", "import sys; print('Traceback: boom'); sys.exit(3)"]
        script = f"""
import json, os
d = {plan.run_dir(run)!r}
os.makedirs(os.path.join(d, "checkpoints"), exist_ok=True)
description = {{"flops_per_step": 1e9, "global_batch": 16, "seq_len": 64}}
json.dump(description, open(os.path.join(d, "run.json"), "w"))
with open(os.path.join(d, "train_log.jsonl"), "w") as f:
    for step in range(1, {plan.steps} + 1):
        print(f"step {{step}} loss 1.0", flush=True)
        entry = {{"step": step, "train/loss": 1.0, "throughput/seconds_per_step": 0.5}}
        f.write(json.dumps(entry) + "\\n")
    f.write(json.dumps({{"step": {plan.steps}, "valid/loss": 2.5}}) + "\\n")
open(os.path.join(d, "checkpoints", "latest"), "w").write("step{plan.steps}")
"""
        return [sys.executable, "-c", script]
    return command


def test_a_failed_run_is_reported_and_the_others_go_on(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "launch_command", fake_launch(failing="bert-a"))
    argv = ["run", "--data", data, "--out", str(tmp_path / "cmp"), "--encodings", "bert-a,rope",
            "--steps", "4", "--nproc", "1", *TINY]
    assert cli.main(argv) == 1
    printed = capsys.readouterr()
    assert "bert-a-seed1: FAILED with exit code 3" in printed.out
    assert "1 run(s) failed: bert-a-seed1" in printed.err
    made = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert [r["state"] for r in made["runs"]] == ["failed (exit 3)", "complete"]
    assert made["runs"][1]["valid"] == {"step": [4], "seconds": [2.0], "flops": [4e9],
                                        "loss": [2.5]}
    assert "Traceback: boom" in (tmp_path / "cmp" / "logs" / "bert-a-seed1.log").read_text()
    markdown = (tmp_path / "cmp" / "report.md").read_text()
    assert "No validation loss of the baseline bert-a yet" in markdown

    monkeypatch.setattr(runner, "launch_command", fake_launch(failing="none"))
    assert cli.main(argv) == 0  # the failed run is retried; the finished one is not started
    assert "rope-seed1: done (4 steps), not started again" in capsys.readouterr().out
    assert read_plan(str(tmp_path / "cmp")).runs == [Run("bert-a", 1), Run("rope", 1)]


def test_the_plan_is_checked_before_anything_runs(data, tmp_path, capsys):
    def error(*flags):
        argv = ["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4", *TINY,
                *flags]
        assert cli.main(argv) == 2
        return capsys.readouterr().err

    assert "--encodings: tupe-x; choose from bert-a" in error("--encodings", "tupe-r,tupe-x")
    assert "--seed: tupe-compare sets it for every run" in error("--encodings", "tupe-r",
                                                                 "--seed", "3")
    assert "run tupe-r-seed1: --tp 2 does not divide the 3 processes" in error(
        "--encodings", "tupe-r", "--nproc", "3", "--tp", "2")
    assert "--baseline nope is not one of --encodings tupe-r" in error(
        "--encodings", "tupe-r", "--baseline", "nope")
    assert not (tmp_path / "cmp").exists()
    assert cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4",
                     "--encodings", "tupe-r,bert-a", "--seeds", "1,2", *TINY]) == 0
    assert "4 runs planned" in capsys.readouterr().out
    assert "this comparison was started with pretrain_flags" in error(
        "--encodings", "tupe-r", "--dropout", "0.2")
    assert cli.main(["run-flags", str(tmp_path / "cmp"), "3"]) == 0  # bert-a, seed 2
    flags = capsys.readouterr().out.split("\n")
    assert flags[flags.index("--pos-encoding") + 1] == "bert-a"
    assert flags[flags.index("--seed") + 1] == "2"
    assert flags[flags.index("--out") + 1] == str(tmp_path / "cmp" / "runs" / "bert-a-seed2")


def curve_record(encoding, seed, losses):
    steps = [10 * (i + 1) for i in range(len(losses))]
    return {"encoding": encoding, "seed": seed,
            "valid": {"step": steps, "loss": losses, "seconds": [s * 2.0 for s in steps],
                      "flops": [s * 1e9 for s in steps]}}


def test_curves_over_seeds_and_the_race_to_the_baseline():
    bert = results.encoding_curve([curve_record("bert-a", 1, [8.0, 7.0, 6.0, 5.0]),
                                  curve_record("bert-a", 2, [8.0, 7.0, 6.2, 5.2])])
    assert bert["mean"] == pytest.approx([8.0, 7.0, 6.1, 5.1])
    assert (bert["low"][2], bert["high"][2], bert["seeds"]) == (6.0, 6.2, 2)
    tupe = results.encoding_curve([curve_record("tupe-r", 1, [7.0, 5.0, 4.0]),  # a shorter run:
                                  curve_record("tupe-r", 2, [7.2, 5.0, 4.2, 3.0])])  # common steps
    assert tupe["step"] == [10, 20, 30]
    race = results.race_to_baseline({"bert-a": bert, "tupe-r": tupe}, "bert-a")
    assert race["target"] == pytest.approx(5.1) and race["baseline_step"] == 40
    assert race["encodings"]["tupe-r"]["step"] == 20  # 5.0 <= 5.1 at step 20
    assert race["encodings"]["tupe-r"]["share_of_baseline_steps"] == 0.5
    assert race["encodings"]["tupe-r"]["seconds"] == 40.0
    assert race["encodings"]["bert-a"]["step"] == 40


def test_finetune_results_become_one_row_per_encoding(tmp_path):
    plan = Plan(out=str(tmp_path), data="d", encodings=("bert-a", "tupe-r"), seeds=(1, 2),
                steps=10, baseline="bert-a", processes=1, pretrain_flags=())
    scores = {"bert-a-seed1": 0.80, "bert-a-seed2": 0.84, "tupe-r-seed1": 0.86}
    for name, score in scores.items():
        os.makedirs(tmp_path / "finetune" / name)
        written = {"tasks": {"sst2": {"best": "lr=2e-05", "dev": {"accuracy": score}},
                             "mrpc": {"best": "lr=1e-05", "dev": {"f1": score - 0.1}}}}
        (tmp_path / "finetune" / name / "results.json").write_text(json.dumps(written))
    table = results.finetune_table(plan)
    assert table["bert-a"]["sst2 dev (accuracy)"] == pytest.approx(0.82)
    assert table["bert-a"]["average"] == pytest.approx((0.82 + 0.72) / 2)
    assert table["tupe-r"] == pytest.approx({"sst2 dev (accuracy)": 0.86, "mrpc dev (f1)": 0.76,
                                             "average": 0.81})


@pytest.mark.parametrize("launcher, module_flag", [("deepspeed", "--module"), ("torchrun", "-m")])
def test_each_run_is_one_launcher_command_with_the_runs_flags(launcher, module_flag):
    plan = Plan(out="/c", data="/d", encodings=("rope",), seeds=(7,), steps=9, baseline="rope",
                processes=4, pretrain_flags=("--model", "tiny", "--lr", "1e-3"))
    command = runner.launch_command(plan, plan.runs[0], launcher)
    program = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run"}
    assert command[:3] == [sys.executable, "-m", program[launcher]]
    assert command[3:5] == ["--num_gpus" if launcher == "deepspeed" else "--nproc_per_node", "4"]
    start = command.index("tupe_ds.pretrain")
    assert command[start - 1] == module_flag
    assert command[start:] == ["tupe_ds.pretrain", "--data", "/d", "--out", "/c/runs/rope-seed7",
                                   "--pos-encoding", "rope", "--seed", "7", "--steps", "9",
                                   "--model", "tiny", "--lr", "1e-3"]
