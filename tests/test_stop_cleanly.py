"""A run file that cannot be written or read while the run trains
(tupe_ds/train/run_folder/files.py) stops every rank alike: exit code 3 on each, one line naming
the file, the error and the newest intact checkpoint, no traceback. Real runs under torchrun (2 CPU
ranks), the fault injected by tests/support/file_fault_worker.py."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from runs import CPU_CONFIG, ROOT, environment, free_port

WORKER = os.path.join(ROOT, "tests", "support", "file_fault_worker.py")
FLAGS = ["--steps", "8", "--save-interval", "2", "--eval-interval", "8", "--dropout", "0"]


def run(data, out, *flags, fault, ignored=None):
    """The output (stdout and stderr) of a run that must stop on the fault on every rank;
    `ignored`: a pattern of output that is not this project's (removed before the checks)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", free_port(), WORKER, "pretrain", "--data", data, "--model", "tiny",
         "--ds-config", CPU_CONFIG, "--out", str(out), "--seq-len", "64", "--log-interval", "1",
         "--eval-samples", "32", *FLAGS, *flags],
        env={**environment(), "TUPE_DS_FILE_FAULT": fault}, capture_output=True, text=True,
        timeout=300, start_new_session=True)
    said = re.sub(ignored, "", result.stdout + result.stderr) if ignored else \
        result.stdout + result.stderr
    assert f"fault fired: {fault}" in said, said[-4000:]
    assert result.returncode == 1, said[-4000:]  # torchrun's for any rank that failed
    for rank in (0, 1):
        assert f"exit worker: rank {rank}, exit code 3" in said, said[-4000:]
    launcher = said.split("Traceback (most recent call last):")[1:]  # torchrun's, of a failed rank
    assert len(launcher) == 1 and "errors.ChildFailedError" in launcher[0], said[-4000:]
    return said


def newest_checkpoint(out):
    return max((n for n in os.listdir(out / "checkpoints") if n.startswith("step")),
               key=lambda name: int(name[len("step"):]))


@pytest.fixture(scope="module")
def stopped_on_a_full_log(data, tmp_path_factory):
    """A run stopped by the full disk of the test below, left as it stopped: (its folder, what it
    said). Its checkpoints (steps 2 and 4) are also the ones a later test's resume reads."""
    out = tmp_path_factory.mktemp("full_log") / "run"
    return out, run(data, out, fault=f"enospc:{out}/train_log.jsonl:7")


@pytest.mark.slow
def test_a_full_disk_on_the_log_between_saves_stops_every_rank_naming_the_newest_checkpoint(
        stopped_on_a_full_log):
    """The 7th append to train_log.jsonl (step 5's line: steps 1-4 and the saves of steps 2
    and 4 wrote the others) fails with ENOSPC."""
    out, said = stopped_on_a_full_log
    line = (f"tupe-pretrain: could not write {out}/train_log.jsonl ([Errno 28] No space left on "
            "device); the newest intact checkpoint is step4 (run the same command once the "
            "filesystem has space and answers: it resumes from there)")
    assert said.count(line) == 1, said[-4000:]
    assert newest_checkpoint(out) == "step4"


@pytest.mark.slow
def test_a_full_disk_under_deepspeeds_tensorboard_stops_every_rank(data, tmp_path):
    """DeepSpeed's own monitor writes its events every step, from TensorBoard's writer thread:
    its failure is said in the line, not as that thread's traceback."""
    out = tmp_path / "run"
    said = run(data, out, fault=f"enospc:{out}/tensorboard/deepspeed/*:4")
    assert said.count("tupe-pretrain: could not write ") == 1, said[-4000:]
    assert f"{out}/tensorboard/deepspeed/" in said and "[Errno 28] No space left on device" in said
    assert "; the newest intact checkpoint is step" in said


@pytest.mark.slow
def test_a_read_error_while_one_rank_loads_the_checkpoint_stops_every_rank(
        stopped_on_a_full_log, data, tmp_path):
    """After verification, DeepSpeed's load fails with EIO on rank 1 alone: every rank stops
    (exit code 3) before any goes on into a collective, nothing moved. The run resumed is a copy
    of the one the full log stopped (newest checkpoint step4), run with the same command."""
    out = tmp_path / "run"
    shutil.copytree(stopped_on_a_full_log[0], out)
    before = sorted(os.listdir(out / "checkpoints"))
    said = run(data, out, fault="eio-load:1")
    assert said.count("tupe-pretrain: could not read ") == 1, said[-4000:]
    assert "([Errno 5] Input/output error): nothing was moved or deleted" in said
    assert sorted(os.listdir(out / "checkpoints")) == before


@pytest.mark.slow
def test_a_read_error_on_the_data_of_one_rank_stops_every_rank(data, tmp_path):
    """Rank 1 cannot open the training data's tokens (EIO): every rank stops at the start. (The
    __del__ of megatron-core's half-built IndexedDataset prints its own "Exception ignored"
    traceback: megatron-core's, ignored here.)"""
    out = tmp_path / "run"
    said = run(data, out, fault=f"eio-open:{data}/train.bin:1", ignored=(
        r"Exception ignored in: <function \w+\.__del__ at 0x[0-9a-f]+>\n"
        r"Traceback \(most recent call last\):\n(?:  .*\n)*AttributeError: .*\n"))
    assert said.count(f"tupe-pretrain: could not open the data {data}/train.bin ([Errno 5] "
                      "Input/output error); the run has no checkpoint yet") == 1, said[-4000:]
