"""tupe-finetune while it trains: lines or a bar within each epoch, TensorBoard and
TASK.log.jsonl (a trial done again after a kill keeps its entries once), and the batch size in
Megatron's spelling (global) or HF's (per device)."""

import fcntl
import json
import os
import re
import select
import statistics
import struct
import termios

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from test_finetune import finetune_flags, sentiment, write_sentiment  # noqa: F401 (a fixture)
from tupe_ds.finetune.monitor import TrialMonitor
from tupe_ds.finetune.progress import hold
from tupe_ds.finetune.run import main as finetune
from tupe_ds.finetune.tasks import TASKS


def flags(files, out, *extra) -> list:
    return ["--model", files["model"], "--task", "sst2", "--train", files["train"], "--valid",
            f"dev={files['valid']}", "--out", str(out), "--lr", "1e-3", "--epochs", "2",
            "--max-length", "32", *extra]


def entries(path) -> list:
    return [json.loads(line) for line in open(path)]


def scalars(folder, tag) -> list:
    events = EventAccumulator(str(folder)).Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.mark.slow
def test_curves_go_to_lines_tensorboard_and_the_log_and_a_redone_trial_is_there_once(
        sentiment, tmp_path, capsys):
    """160 examples in batches of 4: 40 steps an epoch, a log point every 2 (5%)."""
    out = tmp_path / "out"
    files = {**sentiment, "train": write_sentiment(tmp_path / "train160.tsv", 160, 1)}
    assert finetune(flags(files, out, "--seeds", "1,2", "--per-device-train-batch-size",
                          "4")) == 0
    printed = capsys.readouterr().out
    assert "sst2 lr 0.001 seed 1 step 2/80 in epoch 1 (5%): loss " in printed
    assert "sst2 lr 0.001 seed 2 step 78/80 in epoch 2 (95%): loss " in printed
    # 19 of the 20 points of each epoch: the epoch's own line follows the last
    assert printed.count(" to the epoch's end; trial ") == 2 * 2 * 19
    assert printed.count(" to the grid's end\n") == 2 * 2 * 19
    assert re.search(r"seed 1 step 2/80 .*; trial 1 of 2, [0-9:]+ to the grid's end", printed)
    assert re.search(r"seed 2 step 2/80 .*; trial 2 of 2, [0-9:]+ to the grid's end", printed)
    logged = entries(out / "sst2.log.jsonl")
    summary = json.loads((out / "sst2.json").read_text())
    assert summary["settings"]["batch_size"] == 4
    warmup = round(0.06 * 80)
    for seed in (1, 2):
        trial = [entry for entry in logged if entry["seed"] == seed]
        assert all(entry["lr"] == 1e-3 for entry in trial)
        train = [entry for entry in trial if "train/loss" in entry]
        assert [entry["step"] for entry in train] == list(range(2, 81, 2))
        assert train[0]["train/lr"] == pytest.approx(1e-3 * 1 / warmup)  # the step's own rate
        assert train[-1]["train/lr"] == pytest.approx(1e-3 / (80 - warmup))
        ends = [entry for entry in trial if "valid/dev/accuracy" in entry]
        assert [(entry["epoch"], entry["step"]) for entry in ends] == [(1, 40), (2, 80)]
        for end in ends:  # 20 points of 8 examples each
            points = [entry["train/loss"] for entry in train if entry["epoch"] == end["epoch"]]
            assert end["train/epoch_loss"] == pytest.approx(statistics.mean(points))
            assert (f"sst2 lr 0.001 seed {seed} epoch {end['epoch']}/2 train loss "
                    f"{end['train/epoch_loss']:.4f} dev accuracy "
                    f"{end['valid/dev/accuracy']:.4f}") in printed
        final = summary["configurations"]["lr=0.001"]["seeds"][str(seed)]["dev"]["accuracy"]
        assert ends[-1]["valid/dev/accuracy"] == final
        runs = out / "tensorboard" / "sst2" / f"lr=0.001,seed={seed}"
        assert scalars(runs, "train/loss") == [(e["step"], pytest.approx(e["train/loss"]))
                                               for e in train]
        assert [step for step, _ in scalars(runs, "valid/dev/accuracy")] == [40, 80]

    # as if killed during seed 2: its result not kept yet, its entries and a line cut short
    # written, the same command given as --batch-size, in spaces
    progress = json.loads((out / "sst2.progress.json").read_text())
    del progress["results"]["lr=0.001 seed=2"]
    (out / "sst2.progress.json").write_text(json.dumps(progress))
    (out / "sst2.json").unlink()
    before = (out / "sst2.log.jsonl").read_bytes()
    mine = out / "tensorboard" / "sst2" / "hf-baseline"  # the user's: never touched
    mine.mkdir()
    (out / "tensorboard" / "sst2" / "notes.txt").write_text("mine")
    with open(out / "sst2.log.jsonl", "ab") as f:
        f.write(b'{"lr": 0.001, "seed": 2, "ep')
    assert finetune(flags(files, out, "--seeds", "1", "2", "--batch-size", "4")) == 0
    printed = capsys.readouterr().out
    assert printed.count("done before") == 1 and "seed 1 step" not in printed
    again = entries(out / "sst2.log.jsonl")
    assert [e for e in again if e["seed"] == 1] == [e for e in logged if e["seed"] == 1]
    redone = [e for e in again if e["seed"] == 2]
    assert [(e["step"], sorted(e)) for e in redone] == [
        (e["step"], sorted(e)) for e in logged if e["seed"] == 2]  # once, as the first time
    moved = (out / "sst2.log.redone.jsonl").read_bytes().split(b"\n")
    assert moved[-2:] == [b'{"lr": 0.001, "seed": 2, "ep', b""]
    assert [json.loads(line) for line in moved[:-2]] == [e for e in logged if e["seed"] == 2]
    first = b"".join(line + b"\n" for line in before.split(b"\n") if b'"seed": 1,' in line)
    assert (out / "sst2.log.jsonl").read_bytes().startswith(first)  # byte for byte
    run = out / "tensorboard" / "sst2" / "lr=0.001,seed=2"
    assert len(os.listdir(run)) == 1  # the killed attempt's events moved aside, not deleted
    assert len(os.listdir(out / "tensorboard" / "sst2.redone" / "lr=0.001,seed=2.1")) == 1
    assert mine.is_dir() and (out / "tensorboard" / "sst2" / "notes.txt").read_text() == "mine"
    assert [step for step, _ in scalars(run, "train/loss")] == list(range(2, 81, 2))


def test_a_terminal_of_80_columns_gets_a_bar_with_the_trial_the_loss_and_the_grid_s_eta(
        tmp_path, monkeypatch):
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    terminal = open(secondary, "w")
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.delenv("COLUMNS", raising=False)
    monitor = TrialMonitor(str(tmp_path), TASKS["sst2"], 1e-3, 7, epochs=1, steps_per_epoch=40,
                           device="cpu", writer=True, grid=(3, 20, 17))
    monitor.start_epoch(1)
    for step in range(40):
        monitor.trained(loss=0.5, examples=4, lr=2.5e-4)
    monitor.evaluated({"dev": {"accuracy": 0.75}})
    monitor.close()
    terminal.flush()
    shown = b""
    while select.select([primary], [], [], 0)[0]:
        shown += os.read(primary, 1 << 16)
    shown = shown.decode()
    terminal.close()
    os.close(primary)
    frames = [frame for frame in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown))
              if frame.strip()]
    bars = [frame for frame in frames if frame.startswith("sst2 trial 3/20 epoch 1/1 ")]
    assert bars and all(len(frame) <= 80 for frame in frames), frames
    assert any(" | loss 0.5000 | lr 0.00025 | grid ETA " in frame for frame in bars), bars
    assert "sst2 lr 0.001 seed 7 epoch 1/1 train loss 0.5000 dev accuracy 0.7500" in shown
    assert " steps/s," not in shown  # no plain lines beside the bar
    assert [e["step"] for e in entries(tmp_path / "sst2.log.jsonl")] == [*range(2, 41, 2), 40]


def test_the_per_device_and_global_batch_must_agree(sentiment, tmp_path, capsys):
    given = finetune_flags(sentiment, tmp_path / "out", "--per-device-train-batch-size", "8")
    assert finetune(given) == 2  # --batch-size 16 among them: --global-batch-size's alias
    assert ("--per-device-train-batch-size 8 on 1 process is a global batch of 8, not "
            "--global-batch-size 16; give --per-device-train-batch-size 16 for a global batch "
            "of 16, or only one of the two") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_one_fine_tune_of_a_task_in_a_folder_at_once_and_a_log_that_is_no_file_refused(
        sentiment, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    held = hold(str(out), "sst2")  # another tupe-finetune's, running
    assert finetune(flags(sentiment, out, "--seeds", "1", "--batch-size", "4")) == 2
    assert f"another tupe-finetune is fine-tuning sst2 there (it holds {out}/sst2.lock)" in \
        capsys.readouterr().err
    held.close()
    os.mkfifo(out / "sst2.log.jsonl")  # read, it would hang the start
    assert finetune(flags(sentiment, out, "--seeds", "1", "--batch-size", "4")) == 2
    assert "sst2.log.jsonl: not a regular file (a FIFO)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "300")  # more processes than examples: no step would train
    assert finetune(flags(sentiment, tmp_path / "other", "--seeds", "1", "--batch-size",
                          "300")) == 2
    assert "fewer than the 300 processes: no step would train" in capsys.readouterr().err
