"""Signals that stop a run (tupe_ds/train/stop_signal.py): Ctrl-C saves and stops as SIGTERM
does, a second one stops at once; Slurm's warning before the first step ends the job instead of
requeuing it. One tupe-pretrain process each; SIGUSR1 and SIGTERM under the launchers:
test_pretrain.py, test_run_integrity.py, test_multinode.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from runs import CPU_CONFIG, environment, losses

# tupe-pretrain, the signal `SIGNAL` (an environment variable) sent to itself while it opens its
# data: after the engine is built, before its first step
SIGNALLED_AT_START = """
import os, signal, sys
from tupe_ds import pretrain
from tupe_ds.train import loop
open_datasets = loop.open_datasets
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.Signals[os.environ["SIGNAL"]])
    return open_datasets(*args, **kwargs)
loop.open_datasets = signalled
sys.exit(pretrain.main(sys.argv[1:]))
"""


def flags(data, out):
    return ["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out),
            "--seq-len", "64", "--log-interval", "1", "--eval-samples", "32", "--steps", "1000",
            "--save-interval", "1000", "--eval-interval", "1000"]


def started_with(name, data, out):
    result = subprocess.run([sys.executable, "-c", SIGNALLED_AT_START, *flags(data, out)],
                            env={**environment(), "SIGNAL": name}, capture_output=True,
                            text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_at_the_end_of_the_step_and_says_how_to_go_on(data, tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "tupe_ds.pretrain", *flags(data, out)],
                               env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (os.path.exists(out / "train_log.jsonl") and len(losses(out)) >= 3):
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    said = process.communicate(timeout=300)[0]
    assert process.returncode == 0, said[-4000:]
    assert "Traceback" not in said and "KeyboardInterrupt" not in said
    assert "tupe-pretrain: SIGINT: stopping at the end of this step with a checkpoint" in said
    step = int((out / "checkpoints" / "latest").read_text()[4:])
    assert f"stopping at step {step} on SIGINT; run the same command to continue" in said
    assert 3 <= step < 1000 and not (out / "run.lock").exists()


@pytest.mark.slow
def test_ctrl_c_while_the_run_starts_ends_it_with_nothing_to_save(data, tmp_path):
    code, said = started_with("SIGINT", data, tmp_path / "run")
    assert code == 0, said[-4000:]
    assert "Traceback" not in said
    assert ("stopping before step 1 on SIGINT: nothing was trained since the start, there is "
            "nothing to save; run the same command to continue") in said
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_slurms_warning_before_the_first_step_ends_the_job_saying_why(data, tmp_path):
    """A time limit within the USR1 lead plus the start-up: every attempt would be warned before
    its first step. Exit 3 (slurm/srun_requeue.sh requeues only 0), and what to change."""
    code, said = started_with("SIGUSR1", data, tmp_path / "run")
    assert code == 3, said[-4000:]
    assert "Traceback" not in said
    assert ("tupe-pretrain: stopping before step 1 on SIGUSR1: nothing was trained since the "
            "start") in said
    assert "the job is not requeued" in said and "raise sbatch's --time above" in said
    assert not (tmp_path / "run" / "run.lock").exists()


@pytest.mark.slow
def test_slurms_warning_while_the_libraries_import_ends_the_job_saying_why(data, tmp_path):
    """From the moment tupe-pretrain's module runs (python -m, as srun starts it), not once its
    imports are done: SIGUSR1's default action ended the process silently (-10)."""
    process = subprocess.Popen([sys.executable, "-m", "tupe_ds.pretrain",
                                *flags(data, tmp_path / "run")], env=environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    caught, deadline = 0, time.time() + 120
    while not caught >> (signal.SIGUSR1 - 1) & 1:  # its handler installed
        assert process.poll() is None and time.time() < deadline, process.communicate()[0]
        with open(f"/proc/{process.pid}/status") as status:
            caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1],
                         16)
        time.sleep(0.01)
    process.send_signal(signal.SIGUSR1)
    said = process.communicate(timeout=300)[0]
    assert process.returncode == 3, said[-4000:]
    assert "Traceback" not in said and "the job is not requeued" in said
    assert "SIGUSR1 while starting" in said or "stopping before step 1 on SIGUSR1" in said
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_second_ctrl_c_ends_the_process_at_once():
    """As a user at a terminal expects (and a process waiting in a collective too): SIGINT's
    default action, no traceback, nothing saved."""
    script = ("import os, signal, time\n"
              "from tupe_ds.train.stop_signal import StopSignal\n"
              "stop = StopSignal()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "print('asked to stop:', signal.Signals(stop.received[0]).name, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(60)\n"
              "print('still running')\n")
    result = subprocess.run([sys.executable, "-c", script], env=environment(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGINT, result.stderr[-4000:]
    assert result.stdout == "asked to stop: SIGINT\n"
    assert result.stderr.endswith("Ctrl-C again stops at once, without saving\n")
    assert "Traceback" not in result.stderr
