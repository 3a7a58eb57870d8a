"""Pretraining in one process as typed and under the real launchers (deepspeed, torchrun; 2 CPU
processes), tiny models.

`data` (conftest.py) is a small corpus prepared once per test session."""

import glob
import os
import pickletools
import re
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runs import (CPU_CONFIG, EXIT_WORKER, ROOT, assert_quiet, command, environment, log, losses,
                  shipped_config_in_fp32, train)
from tupe_ds.distributed.parallel import share_cpu_cores


def pickled_classes(folder) -> set:
    """The "module name" of every class the .pt files under `folder` pickle (torch's zip format)."""
    found = set()
    for path in glob.glob(os.path.join(folder, "**", "*.pt"), recursive=True):
        with zipfile.ZipFile(path) as archive:
            pickle = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
            strings = []
            for opcode, argument, _ in pickletools.genops(archive.read(pickle)):
                if opcode.name == "GLOBAL":
                    found.add(argument)
                elif opcode.name == "STACK_GLOBAL":
                    found.add(" ".join(strings[-2:]))
                if isinstance(argument, str):
                    strings.append(argument)
    return found


def assert_progress_lines(stdout: str, out, steps: int) -> None:
    """A progress line every step (--log-interval 1), the CPU's fields only (no TFLOPS, MFU or
    memory), and the summary of a run that trained all its steps in one start."""
    progress = [line for line in stdout.splitlines() if line.startswith("step ") and " | " in line]
    number = r"[0-9]+(\.[0-9]+)?"
    clock = "[0-9]+:[0-9]{2}:[0-9]{2}"
    count = r"[0-9.]+[kMB]?"
    pattern = (rf"step +([0-9]+)/{steps} \| loss {number} \| lr [0-9.]+e[-+][0-9]{{2}} \| "
               rf"grad norm {number} \| {number} ms/step \| {count} tokens/s \| "
               rf"{count} tokens/s/GPU \| {number} samples/s \| {count} tokens seen \| "
               rf"elapsed {clock} \| ETA {clock} \| skipped 0")
    matches = [re.fullmatch(pattern, line) for line in progress]
    assert all(matches), progress
    assert [int(match.group(1)) for match in matches] == list(range(1, steps + 1))
    # the step right-aligned: the fields stack
    assert {line.index(" | ") for line in progress} == {len(f"step {steps}/{steps}")}
    assert progress[-1].endswith(" | ETA 0:00:00 | skipped 0")
    entries = log(out)
    best = min((e["valid/loss"], step) for step, e in entries.items() if "valid/loss" in e)
    summary = stdout[stdout.index(f"final valid loss {entries[steps]['valid/loss']:.4f} at step "
                                  f"{steps}\n"):].splitlines()
    assert re.fullmatch(rf"this start trained steps 1-{steps} of {steps} in {clock} \(wall time "
                        rf"since its process started\); the run's training time {clock}",
                        summary[1]), summary
    assert summary[2:6] == [f"best valid loss {best[0]:.4f} at step {best[1]}",
                            f"newest checkpoint {out}/checkpoints/step{steps}",
                            f"log {out}/train_log.jsonl", f"tensorboard --logdir {out}/tensorboard"]


# tupe-r in one process as typed, bert-a under the deepspeed launcher on 2 ranks (what a rank
# other than 0 must not say, and DeepSpeed's monitor of a data-parallel run)
@pytest.mark.parametrize("encoding, launcher, processes",
                         [("tupe-r", None, 1), ("bert-a", "deepspeed", 2)])
@pytest.mark.slow
def test_loss_falls_and_tensorboard_has_the_run(data, tmp_path, encoding, launcher,
                                                processes):
    out = tmp_path / encoding
    stdout = train(launcher, processes, data, out, "--pos-encoding", encoding, "--steps", "30",
                   "--warmup-steps", "5", "--lr", "2e-3", "--eval-interval", "15",
                   "--image-interval", "30")
    loss = losses(out)
    assert loss[30] < loss[1] - 0.5, loss  # a model that learns nothing moves by ~0.05
    valid = {s: e["valid/loss"] for s, e in log(out).items() if "valid/loss" in e}
    assert valid[30] < valid[15], valid
    assert_progress_lines(stdout, out, 30)
    # Checkpoints name no tupe_ds module (they load whatever tupe_ds's folders are called), and
    # the scan sees what they do name
    classes = pickled_classes(out / "checkpoints")
    assert "collections OrderedDict" in classes and not any("tupe_ds" in c for c in classes)

    events = EventAccumulator(str(out / "tensorboard" / "tupe"), size_guidance={"images": 0}).Reload()
    tags = events.Tags()
    for tag in ("train/loss", "train/lr", "train/grad_norm", "valid/loss", "valid/accuracy",
                "throughput/samples_per_s", "throughput/tokens_per_s", "throughput/tflops_per_rank",
                "throughput/tokens_per_s_per_gpu", "train/tokens_seen",
                "throughput/data_loading_percent",
                "train/skipped_steps", "time/elapsed_seconds", "time/eta_seconds"):
        assert tag in tags["scalars"], tag
    assert not {"throughput/mfu_percent", "memory/max_allocated_gib"} & set(tags["scalars"])
    assert events.Scalars("time/eta_seconds")[-1].value == 0  # at step 30 of 30
    assert 0 < events.Scalars("valid/accuracy")[-1].value < 1
    assert events.Scalars("throughput/tflops_per_rank")[-1].value > 0
    assert max(e.value for e in events.Scalars("train/lr")) == pytest.approx(2e-3, rel=0.05)
    assert [(e.step, e.value) for e in events.Scalars("train/mask_rate")] == \
        [(1, pytest.approx(0.15))]  # each start's first log line
    if encoding == "tupe-r":
        assert {f"positional_logits/head{h}" for h in range(4)} <= set(tags["images"])
    deepspeed_events = EventAccumulator(str(out / "tensorboard" / "deepspeed")).Reload()
    # DeepSpeed's own monitor: each step's lr at the samples after it, the rate train/lr has (it
    # read the next step's)
    samples = {e.step: e.value for e in deepspeed_events.Scalars("Train/Samples/lr")}
    rates = {e.step: e.value for e in events.Scalars("train/lr")}
    batch = min(samples)  # the global batch: the first step's samples
    assert {step // batch: rate for step, rate in samples.items()} == pytest.approx(rates)


# Two layouts against one rank: 5 steps, dropout off, in global batches of 16, each split
# otherwise; the loss is normalised per token, so the split does not change the steps (every
# layout: test_loss_normalization.py).
SPLIT = ["--pos-encoding", "tupe-r", "--steps", "5", "--dropout", "0", "--global-batch", "16",
         "--eval-interval", "5", "--lr", "1e-3", "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def one_rank(data, tmp_path_factory):
    """The log of the reference of the two tests below: SPLIT in one process with the CPU
    config, in micro-batches of 4 (4 x 4), its batches read the reference way (sample by sample,
    in the step): the same batches as the other runs' vectorised, prefetched ones."""
    out = tmp_path_factory.mktemp("one_rank") / "tp1"
    train(None, 1, data, out, *SPLIT, "--micro-batch", "4", "--data-stream", "per-sample",
          "--prefetch", "0")
    return log(out)


@pytest.mark.slow
def test_the_shipped_config_on_two_ranks_equals_one_rank_split_otherwise(
        data, tmp_path, one_rank):
    """The shipped BERT config's step (ZeRO-1 without gradient hooks, fused AdamW), its
    micro-batch of 128 cut to each rank's share of 8 and said so, against one rank in
    micro-batches of 4 (`one_rank`: the CPU config's AdamW, of the same settings, at ZeRO-2)."""
    flags = [*SPLIT, "--ds-config", shipped_config_in_fp32("bert_base_fp16.json", tmp_path)]
    stdout = train("deepspeed", 2, data, tmp_path / "dp2", *flags)
    assert ("global batch 16 = micro-batch 8 x accumulation 1 x dp 2 (" in stdout
            and "micro-batch 128 lowered to 8, each rank's share" in stdout)
    two = log(tmp_path / "dp2")
    for step in range(1, 6):
        assert two[step]["train/loss"] == pytest.approx(one_rank[step]["train/loss"], rel=1e-4,
                                                        abs=1e-4)
    assert two[5]["valid/loss"] == pytest.approx(one_rank[5]["valid/loss"], rel=1e-4, abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_two_equals_one_under_torchrun(data, tmp_path, one_rank):
    """tp=2 (2 processes, micro-batches of 8: 8 x 2) against `one_rank`: the logged loss agrees
    at every step."""
    train("torchrun", 2, data, tmp_path / "tp2", "--tp", "2", *SPLIT, "--micro-batch", "8")
    two = log(tmp_path / "tp2")
    for step in range(1, 6):
        assert two[step]["train/loss"] == pytest.approx(one_rank[step]["train/loss"], rel=1e-4,
                                                        abs=1e-4), step


@pytest.mark.slow
def test_one_process_needs_no_launcher_no_mpi_and_no_port(data, tmp_path):
    """tupe-pretrain typed as is, twice at once on one machine, where no MPI library loads
    (mpi4py pointed at none), no launcher set RANK or MASTER_PORT and DS_ACCELERATOR is unset:
    both train, each in a group of its own, print no third-party noise, and neither leaves
    DeepSpeed's shared-memory buffers in /dev/shm."""
    env = {name: value for name, value in environment().items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "DS_ACCELERATOR")
           and not name.startswith(("OMPI_", "PMI_", "SLURM_"))}
    env["MPI4PY_LIBMPI"] = str(tmp_path / "no-libmpi.so")
    shared_memory_before = set(os.listdir("/dev/shm"))
    flags = ["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64",
             "--log-interval", "1", "--eval-samples", "32", "--steps", "3"]
    runs = [subprocess.Popen([sys.executable, EXIT_WORKER, "pretrain", *flags, "--out",
                              str(tmp_path / f"run{index}")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for index in range(2)]
    outputs = [run.communicate(timeout=400)[0] for run in runs]
    for index, (run, output) in enumerate(zip(runs, outputs)):
        assert run.returncode == 0, output[-4000:]
        assert "1 process, no launcher" in output
        assert_quiet(output)
        assert sorted(losses(tmp_path / f"run{index}")) == [1, 2, 3]
        assert not (tmp_path / f"run{index}" / "compile-cache").exists()  # eager on a CPU
    left = {name for name in set(os.listdir("/dev/shm")) - shared_memory_before
            if name.startswith("deepspeed")}
    assert not left


def wait_for(condition, process, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.slow
def test_sigusr1_saves_a_checkpoint_and_stops_cleanly(data, tmp_path):
    out = tmp_path / "preempted"
    process = subprocess.Popen(command("torchrun", 2, data, out, "--steps", "1000",
                                       "--save-interval", "1000", "--eval-interval", "1000"),
                               env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    wait_for(lambda: os.path.exists(out / "train_log.jsonl") and len(losses(out)) >= 3, process)
    workers = subprocess.run(["pgrep", "-f", f"exit_worker.py pretrain.*{out}"],
                             capture_output=True, text=True).stdout.split()
    workers = [int(pid) for pid in workers if int(pid) != process.pid]
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGUSR1)  # one rank only: every rank must stop with it
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0, stdout[-4000:]
    assert "stopping at step" in stdout and "run the same command to continue" in stdout
    step = int((out / "checkpoints" / "latest").read_text()[4:])
    assert 3 <= step < 1000


@pytest.mark.slow
def test_fp16_without_cuda_stops_before_training_and_names_the_cpu_config(data, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tupe_ds.pretrain", "--data", data, "--out", str(tmp_path / "x"),
         "--ds-config", os.path.join(ROOT, "ds_configs", "bert_base_fp16.json"), "--steps", "1"],
        env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ds_configs/cpu_zero2.json" in result.stderr
    assert not os.path.exists(tmp_path / "x")


def test_cpu_ranks_share_the_cores_unless_omp_num_threads_says():
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        for environ, threads in (({"LOCAL_SIZE": "2"}, max(1, cores // 2)),  # deepspeed's
                                 ({"LOCAL_WORLD_SIZE": str(4 * cores)}, 1),  # torchrun's
                                 ({}, cores),  # one process
                                 ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, None)):
            torch.set_num_threads(7)
            share_cpu_cores(environ)
            assert torch.get_num_threads() == (threads or 7), environ
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_one_process_variables_are_removed_when_its_group_ends():
    """A notebook or test that runs a command's main() in its own process: RANK, WORLD_SIZE and
    LOCAL_RANK exist while the one-process group does, and not afterwards (a process it starts
    later, under srun or mpirun, reads its own). In a process of its own: this one may hold a
    group another test left."""
    probe = (
        "import os, torch.distributed as dist\n"
        "from tupe_ds.distributed.parallel import end_distributed, start_distributed\n"
        "start_distributed('gloo')\n"
        "during = [dist.get_world_size(), os.environ['RANK'], os.environ['WORLD_SIZE']]\n"
        "end_distributed()\n"
        "print(during, dist.is_initialized(), 'RANK' in os.environ, 'WORLD_SIZE' in os.environ,\n"
        "      os.environ['LOCAL_RANK'])\n")
    env = {name: value for name, value in environment().items()
           if name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["LOCAL_RANK"] = "0"  # one given by the caller stays
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split("\n")[-2] == "[1, '0', '1'] False False False 0", \
        result.stdout[-2000:] + result.stderr[-2000:]
