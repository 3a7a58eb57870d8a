"""tupe-compare: a real tiny comparison with fine-tunes on two GLUE-layout tasks made here
(killed while pretraining and again while fine-tuning, resumed, re-run), its report against the
runs' own logs and Table 1 against the fine-tunes' own results, a failing run among others, the
plan's checks, and the report's arithmetic (Table 1's intervals: test_glue_table.py). The Slurm
arrays are in test_slurm.py."""

import contextlib
import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runs import CPU_CONFIG, assert_quiet, environment, log
from test_finetune import FILLER, write_sentiment
from tupe_ds.compare import cli, finetuning, results, runner
from tupe_ds.compare.plan import Plan, Run, read_plan
from tupe_ds.finetune.monitor import trial_of
from tupe_ds.train.checkpoint import history, manifest
from tupe_ds.train.config import load

TINY = ["--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64", "--log-interval", "2",
        "--eval-samples", "32", "--lr", "2e-3", "--warmup-steps", "2"]


def compare_command(data, out, *flags):
    return [sys.executable, "-m", "tupe_ds.compare.cli", "run", "--data", data, "--out", str(out),
            *TINY, *flags]


def write_similarity(path, count, seed):
    """An STS-B style TSV (GLUE's columns): pairs scored 0-5 by the share of words they have in
    common."""
    rng = random.Random(seed)
    lines = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
             "sentence2\tscore"]
    for index in range(count):
        first = rng.sample(FILLER, 4)
        shared = rng.randrange(5)
        second = first[:shared] + rng.sample([w for w in FILLER if w not in first], 4 - shared)
        lines.append(f"{index}\tmain\tmade\t2026\t{index}\tnone\tnone\t{' '.join(first)}\t"
                     f"{' '.join(second)}\t{5 * shared / 4:.3f}")
    path.write_text("\n".join(lines) + "\n")


def write_glue(root, sentiment=48, similarity=48) -> str:
    """GLUE's layout with two tasks made here: SST-2 (classification) and STS-B (regression),
    each with a dev set half the size of its training set."""
    for folder, write, examples in (("SST-2", write_sentiment, sentiment),
                                    ("STS-B", write_similarity, similarity)):
        os.makedirs(root / folder)
        write(root / folder / "train.tsv", examples, 1)
        write(root / folder / "dev.tsv", examples // 2, 2)
    return str(root)


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


def killed_when(command, reached):
    """Starts tupe-compare and kills it (the runner, its launcher and its ranks) once reached()."""
    started = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not reached():
        assert started.poll() is None and time.time() < deadline, started.stdout.read()[-3000:]
        time.sleep(0.02)
    os.killpg(started.pid, signal.SIGKILL)
    started.wait()


def compared(command) -> subprocess.CompletedProcess:
    """tupe-compare's command run in this process, as in its own (the processes it starts given
    the same environment): a process start fewer where the test needs no process of its own."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        for name, value in environment().items():
            patch.setenv(name, value)
        code = cli.main(command[3:])
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="module")
def killed_comparison(data, tmp_path_factory):
    """A real tiny comparison of bert-a and tupe-r with fine-tunes on two GLUE-layout tasks made
    here, as a user runs it: killed while bert-a pretrains, the same command killed again mid-way
    through bert-a's first fine-tune (both under the deepspeed launcher), the same command under
    torchrun (the launcher is the command's, not the comparison's) to the end, and once more;
    what the tests read of each. One process per run and fine-tune: nothing here depends on the
    ranks (tupe-pretrain's kills and resumes over two ranks: test_run_integrity.py;
    tupe-finetune's over two: test_finetune.py), and each rank is a process start of its own."""
    root = tmp_path_factory.mktemp("compare")
    out = root / "cmp"
    # 240 examples in batches of 8: 30 steps a trial, enough for a kill to land within the grid
    glue = write_glue(root / "glue", sentiment=240)
    flags = ["--encodings", "bert-a,tupe-r", "--steps", "40", "--nproc", "1", "--eval-interval",
             "10", "--save-interval", "5", "--finetune", glue, "--finetune-lr", "1e-3", "3e-4",
             "--finetune-seeds", "1", "2", "3", "--finetune-epochs", "1",
             "--finetune-global-batch-size", "8", "--finetune-max-length", "32"]
    deepspeed = compare_command(data, out, *flags)
    torchrun = compare_command(data, out, *flags, "--launcher", "torchrun")
    found = {"out": out}

    killed_when(deepspeed, lambda: latest_step(out / "runs" / "bert-a-seed1") >= 5)
    found["killed_at"] = latest_step(out / "runs" / "bert-a-seed1")
    progress = out / "finetune" / "bert-a-seed1" / "sst2.progress.json"
    killed_when(deepspeed, progress.exists)
    found["kept"] = json.loads(progress.read_text())["results"]
    found["finished_at_the_kill"] = (progress.parent / "sst2.json").exists()

    found["finished"] = compared(torchrun)
    found["made"] = json.loads((out / "report.json").read_text())
    found["logs"] = {name: (out / "runs" / name / "train_log.jsonl").read_bytes()
                     for name in ("bert-a-seed1", "tupe-r-seed1")}
    found["exported"] = (out / "exports" / "tupe-r-seed1" / "model.safetensors").stat(
    ).st_mtime_ns
    found["written"] = {path: path.stat().st_mtime_ns
                        for path in (out / "finetune").glob("*/*.json")}
    # a process of its own, as the finishing one is not: a report that differs with what
    # differs between processes (the order of a set of strings) differs here
    found["again"] = subprocess.run(torchrun, env=environment(), capture_output=True, text=True,
                                    timeout=300)
    return found


@pytest.mark.slow
def test_a_killed_comparison_resumes_reports_the_logs_numbers_and_reruns_nothing(
        killed_comparison):
    out, killed_at = killed_comparison["out"], killed_comparison["killed_at"]
    assert killed_at < 40
    result = killed_comparison["finished"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_log = (out / "logs" / "bert-a-seed1.log").read_text()
    assert f"resumed at step {killed_at} of 40" in run_log
    assert_quiet(run_log)  # the deepspeed launcher's and DeepSpeed's lines left out

    made = killed_comparison["made"]
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

    logs = killed_comparison["logs"]
    again = killed_comparison["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("steps), not started again") == 2
    assert {name: (out / "runs" / name / "train_log.jsonl").read_bytes() for name in logs} == logs
    assert (out / "exports" / "tupe-r-seed1" / "model.safetensors").stat().st_mtime_ns == \
        killed_comparison["exported"]
    assert json.loads((out / "report.json").read_text()) == made


@pytest.mark.slow
def test_fine_tunes_on_glue_tasks_are_killed_redone_and_become_table_1(killed_comparison):
    out, kept = killed_comparison["out"], killed_comparison["kept"]
    assert 1 <= len(kept) < 6 and not killed_comparison["finished_at_the_kill"]

    result = killed_comparison["finished"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bert-a-seed1: done (40 steps), not started again" in result.stdout
    redone = (out / "logs" / "bert-a-seed1.sst2.log").read_text().split("tupe_ds.finetune.run")
    assert len(redone) == 3  # two attempts, each starting with its command line
    assert redone[2].count("done before") == len(kept)
    assert redone[2].count("train loss") == 6 - len(kept)
    # its curves: every trial once in its log and TensorBoard, the killed attempt's unfinished
    # trial's entries moved aside (240 examples in batches of 8: 30 steps, a point every 2)
    killed = out / "finetune" / "bert-a-seed1"
    logged = [json.loads(line) for line in open(killed / "sst2.log.jsonl")]
    summary = json.loads((killed / "sst2.json").read_text())
    for lr in ("0.001", "0.0003"):
        for seed in ("1", "2", "3"):
            trial = [e for e in logged if (f"{e['lr']:g}", str(e["seed"])) == (lr, seed)]
            steps = [entry["step"] for entry in trial if "train/loss" in entry]
            assert steps == list(range(2, 31, 2)) and trial[-1]["step"] == 30
            assert trial[-1]["valid/dev/accuracy"] == summary["configurations"][f"lr={lr}"][
                "seeds"][seed]["dev"]["accuracy"]
            events = killed / "tensorboard" / "sst2" / f"lr={lr},seed={seed}"
            assert len(os.listdir(events)) == 1  # a trial done again: the first attempt's gone
            assert [e.step for e in EventAccumulator(str(events)).Reload().Scalars(
                "train/loss")] == steps
    moved = killed / "sst2.log.redone.jsonl"
    for line in moved.read_bytes().splitlines() if moved.exists() else []:
        assert trial_of(line) not in kept  # a trial the kill left unfinished, or a torn line
    made = killed_comparison["made"]
    finetune = made["finetune"]
    assert finetune["tasks"] == ["sst2", "stsb"] and set(finetune["states"].values()) == {
        "complete"}
    table = finetune["table"]
    assert table["columns"] == ["sst2", "stsb", "average"]
    chosen = {}
    for encoding in ("bert-a", "tupe-r"):
        written = {task: json.loads((out / "finetune" / f"{encoding}-seed1" / f"{task}.json")
                                    .read_text()) for task in ("sst2", "stsb")}
        assert set(written["sst2"]["configurations"]) == {"lr=0.001", "lr=0.0003"}
        scores = {task: 100 * summary["best_median"]["dev"][summary["metric"]]
                  for task, summary in written.items()}
        row = table["scores"][encoding]
        assert {task: row[task]["mean"] for task in scores} == scores
        assert row["average"]["mean"] == pytest.approx((scores["sst2"] + scores["stsb"]) / 2)
        if encoding == "bert-a":
            assert written["sst2"]["configurations"]["lr=0.001"]["seeds"]["1"] == kept[
                "lr=0.001 seed=1"]  # kept from the killed attempt
        stsb = written["stsb"]  # each seed at the chosen learning rate
        chosen[encoding] = {seed: 100 * run["dev"][stsb["metric"]]
                            for seed, run in stsb["configurations"][stsb["best"]]["seeds"].items()}
    difference = table["differences"]["tupe-r"]["stsb"]
    assert difference["difference"] == pytest.approx(
        sum(chosen["tupe-r"][s] - chosen["bert-a"][s] for s in ("1", "2", "3")) / 3)
    assert difference["low"] <= difference["difference"] <= difference["high"]
    assert difference["method"] == ("paired t over 3 fine-tuning seeds of one pretraining seed, "
                                    "the mean at each encoding's chosen learning rate "
                                    "(fine-tuning noise only)")
    markdown = (out / "report.md").read_text()
    assert "GLUE average minus bert-a's: tupe-r" in markdown and "| bert-a | " in markdown
    assert "| tupe-r, lr held out | " in markdown and "The rule: paired t" in markdown
    assert "Pretraining: bert-a's final validation loss" in markdown

    written = killed_comparison["written"]
    again = killed_comparison["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("fine-tuned before, not started again") == 4
    assert {path: path.stat().st_mtime_ns for path in written} == written
    assert json.loads((out / "report.json").read_text()) == made


def fake_launch(failing: str):
    """runner.launch_command for tests: the run of `failing` exits 3; any other run writes what a
    finished tupe-pretrain leaves (run.json, train_log.jsonl, a complete checkpoint: a step
    folder with its manifest, `latest` and the history that records it)."""
    def command(plan, run, launcher, port):
        if run.encoding == failing:
            return [sys.executable, "-c", "import sys; print('Traceback: boom'); sys.exit(3)"]
        argv = plan.pretrain_argv(run)
        with tempfile.TemporaryDirectory() as scratch:  # the run as its command makes it
            argv[argv.index("--out") + 1] = scratch
            made = load(argv, world_size=1)
            record = {"tag": f"step{plan.steps}", "step": plan.steps, "lineage": run.name,
                      "identity": made.identity, "training": made.training, "files": {},
                      "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1,
                                 "zero_stage": made.ds_config["zero_optimization"]["stage"],
                                 "micro_batch": made.batch_split.micro_batch or 1,
                                 "gradient_accumulation": made.batch_split.accumulation or 1,
                                 "vocab_size": made.models[0].vocab_size}}
            # by the checkpoints' own writer, here: the run's process then imports no torch
            manifest.write(scratch, record)
            with open(os.path.join(scratch, manifest.MANIFEST)) as f:
                written = f.read()
            history.append(scratch, [], [  # the run's start, then the checkpoint's commit
                history.record("attempt", lineage=run.name),
                history.record("committed", id=history.checkpoint_id(json.loads(written)),
                               step=plan.steps, lineage=run.name, files={})])
            with open(os.path.join(scratch, history.FILE)) as f:
                journal = f.read()
        script = f"""
import json, os
d = {plan.run_dir(run)!r}
os.makedirs(os.path.join(d, "checkpoints"), exist_ok=True)
description = {{"flops_per_step": 1e9, "global_batch": 16, "seq_len": 64}}
json.dump(description, open(os.path.join(d, "run.json"), "w"))
with open(os.path.join(d, "train_log.jsonl"), "w") as f:
    for step in range(1, {plan.steps} + 1):
        print(f"step {{step}}/{plan.steps} | loss 1.0", flush=True)
        entry = {{"step": step, "train/loss": 1.0, "throughput/seconds_per_step": 0.5}}
        f.write(json.dumps(entry) + "\\n")
    f.write(json.dumps({{"step": {plan.steps}, "valid/loss": 2.5}}) + "\\n")
step_dir = os.path.join(d, "checkpoints", "step{plan.steps}")
os.makedirs(step_dir, exist_ok=True)
open(os.path.join(step_dir, {manifest.MANIFEST!r}), "w").write({written!r})
open(os.path.join(d, "checkpoints", "latest"), "w").write("step{plan.steps}")
open(os.path.join(d, {history.FILE!r}), "w").write({journal!r})
"""
        return [sys.executable, "-c", script]
    return command


@pytest.mark.slow
def test_a_failed_run_is_reported_and_the_others_go_on(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "launch_command", fake_launch(failing="bert-a"))
    argv = ["run", "--data", data, "--out", str(tmp_path / "cmp"), "--encodings", "bert-a,rope",
            "--steps", "4", "--nproc", "1", *TINY]
    assert cli.main(argv) == 1
    printed = capsys.readouterr()
    assert "bert-a-seed1: FAILED with exit code 3" in printed.err
    assert "1 run(s) or fine-tune(s) failed: bert-a-seed1;" in printed.err
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


@pytest.mark.slow
def test_a_failed_fine_tune_is_recorded_and_the_others_go_on(data, tmp_path, monkeypatch,
                                                             capsys):
    monkeypatch.setattr(runner, "launch_command", fake_launch(failing="none"))
    monkeypatch.setattr(finetuning, "export_for", lambda plan, run: plan.export_dir(run))
    monkeypatch.setattr(finetuning, "is_finished", lambda plan, run, task: False)
    started = []

    def fake_finetune(launcher, processes, module, argv, port):
        task = argv[argv.index("--task") + 1]
        started.append((argv[argv.index("--model") + 1].split(os.sep)[-1], task))
        return [sys.executable, "-c", f"import sys; sys.exit({3 if task == 'stsb' else 0})"]

    monkeypatch.setattr(finetuning, "launcher_command", fake_finetune)
    out = tmp_path / "cmp"
    argv = ["run", "--data", data, "--out", str(out), "--encodings", "bert-a,rope", "--steps",
            "4", "--nproc", "1", "--finetune", write_glue(tmp_path / "glue"), *TINY]
    assert cli.main(argv) == 1
    printed = capsys.readouterr()
    assert started == [("bert-a-seed1", "sst2"), ("bert-a-seed1", "stsb"),
                       ("rope-seed1", "sst2"), ("rope-seed1", "stsb")]
    assert "bert-a-seed1/stsb: FAILED with exit code 3" in printed.err
    assert "2 run(s) or fine-tune(s) failed: bert-a-seed1/stsb, rope-seed1/stsb" in printed.err
    states = json.loads((out / "report.json").read_text())["finetune"]["states"]
    assert states == {"bert-a-seed1/sst2": "not done", "bert-a-seed1/stsb": "failed (exit 3)",
                      "rope-seed1/sst2": "not done", "rope-seed1/stsb": "failed (exit 3)"}
    assert "bert-a-seed1/stsb failed (exit 3)" in (out / "report.md").read_text()


def test_the_plan_is_checked_before_anything_runs(data, tmp_path, capsys, monkeypatch):
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
    monkeypatch.chdir(tmp_path)  # a relative path among the runs' flags: absolute in the plan
    assert cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp2"), "--steps", "4",
                     "--encodings", "tupe-r", *TINY, "--index-cache", "cache"]) == 0
    assert cli.main(["run-flags", str(tmp_path / "cmp2"), "0"]) == 0
    flags = capsys.readouterr().out.split("\n")
    assert flags[flags.index("--index-cache") + 1] == str(tmp_path / "cache")

    glue = write_glue(tmp_path / "glue")
    other = ["--encodings", "tupe-r,bert-a", "--seeds", "1,2"]
    assert "--finetune-lr needs --finetune GLUE_DIR" in error(*other, "--finetune-lr", "1e-5")
    assert f"--finetune {tmp_path / 'none'}: no such folder" in error(
        *other, "--finetune", str(tmp_path / "none"))
    assert "--tasks: wnli; choose from cola, sst2" in error(*other, "--finetune", glue,
                                                            "--tasks", "wnli")
    assert f"task rte: {glue}/RTE/train.tsv: no such file" in error(
        *other, "--finetune", glue, "--tasks", "sst2,rte")
    (tmp_path / "glue" / "STS-B" / "dev.tsv").write_text("sentence1\tsentence2\tscore\n"
                                                         "a\tb\thigh\n")
    assert f"task stsb: {glue}/STS-B/dev.tsv:2: score 'high' is not a number" in error(
        *other, "--finetune", glue)
    assert cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4",
                     *TINY, *other, "--finetune", glue, "--tasks", "sst2",
                     "--finetune-seeds", "1,2"]) == 0
    assert "4 fine-tunes planned: each run on sst2" in capsys.readouterr().out
    commas = read_plan(str(tmp_path / "cmp"))
    assert cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4",
                     *TINY, "--encodings", "tupe-r", "bert-a", "--seeds", "1", "2", "--finetune",
                     glue, "--tasks", "sst2", "--finetune-seeds", "1", "2",
                     "--finetune-batch-size", "8"]) == 0  # spaces, and the batch's earlier name
    spaces = read_plan(str(tmp_path / "cmp"))
    assert (spaces.encodings, spaces.seeds, spaces.tasks) == (commas.encodings, commas.seeds,
                                                              commas.tasks) == (
        ("tupe-r", "bert-a"), (1, 2), ("sst2",))
    assert spaces.finetune_flags == ("--seeds", "1", "2", "--global-batch-size", "8")
    assert ("--finetune-global-batch-size 1: fewer examples than the 2 processes (--nproc) of "
            "each fine-tune; give at least 2") in error(*other, "--finetune", glue, "--nproc", "2",
                                                        "--finetune-global-batch-size", "1")
    with pytest.raises(SystemExit):
        cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4",
                  "--encodings", "rope", "--seeds", ","])
    assert "argument --seeds: give at least one value" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # neither command's flag: tupe-compare's error
        cli.main(["plan", "--data", data, "--out", str(tmp_path / "cmp"), "--steps", "4",
                  "--encodings", "rope", "--finetune-lrr", "1e-5"])
    assert ("tupe-compare plan: error: --finetune-lrr: not a flag of tupe-compare plan nor of "
            "tupe-pretrain; --finetune-lrr: did you mean --finetune-lr?\nsee tupe-compare plan "
            "--help\n") == capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "tupe-compare report cmp/" in capsys.readouterr().out
    assert cli.main(["report", "-h"]) == 0
    assert capsys.readouterr().out == "usage: tupe-compare report OUT\n"
    assert cli.main(["--verbose", "report", "-h"]) == 0  # --verbose before the command too
    assert capsys.readouterr().out == "usage: tupe-compare report OUT\n"
    assert "tupe-r-seed2 has 0 of 4 steps: not fine-tuned on sst2" in error_of(
        ["finetune-flags", str(tmp_path / "cmp"), "1"], capsys)
    assert "usage: tupe-compare finetune-flags OUT INDEX, INDEX below 4" in error_of(
        ["finetune-flags", str(tmp_path / "cmp"), "4"], capsys)
    assert cli.main(["finetune-ended", str(tmp_path / "cmp"), "1", "2", "/logs/1.out"]) == 0
    status = json.loads((tmp_path / "cmp" / "status.json").read_text())
    assert status == {"tupe-r-seed2/sst2": {"exit": 2, "log": "/logs/1.out"}}


def error_of(argv, capsys) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_make_compare_passes_the_glue_folder_and_the_grid():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    made = subprocess.run(["make", "-s", "-n", "-C", root, "compare", "COMPARE_FINETUNE=/glue",
                           "COMPARE_FINETUNE_FLAGS=--tasks rte --finetune-seeds 1,2"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    command = " ".join(made.stdout.replace("\\\n", " ").split())
    assert "tupe-compare run --data build/sample-prep-2048" in command
    assert command.endswith("--log-interval 10 --finetune /glue --tasks rte --finetune-seeds 1,2")
    plain = subprocess.run(["make", "-n", "-C", root, "compare"], capture_output=True, text=True,
                           timeout=60)
    assert "--finetune" not in plain.stdout


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


@pytest.mark.parametrize("launcher, module_flag, data", [
    ("deepspeed", "--module", ("/d",)), ("torchrun", "-m", ("/d",)),
    ("torchrun", "-m", ("0.7", "/wiki", "0.3", "/books"))])
def test_each_run_is_one_launcher_command_with_the_runs_flags(launcher, module_flag, data):
    plan = Plan(out="/c", data=data, encodings=("rope",), seeds=(7,), steps=9, baseline="rope",
                processes=4, pretrain_flags=("--model", "tiny", "--lr", "1e-3"))
    command = runner.launch_command(plan, plan.runs[0], launcher, 29511)
    program = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run"}
    assert command[:3] == [sys.executable, "-m", program[launcher]]
    assert command[3:5] == ["--num_gpus" if launcher == "deepspeed" else "--nproc_per_node", "4"]
    start = command.index("tupe_ds.pretrain")
    assert command[start - 1] == module_flag
    assert command[start:] == ["tupe_ds.pretrain", "--data", *data, "--out", "/c/runs/rope-seed7",
                               "--pos-encoding", "rope", "--seed", "7", "--steps", "9",
                               "--model", "tiny", "--lr", "1e-3"]
