"""Running tupe-pretrain as the tests do: under a real launcher through exit_worker.py, with the
CPU settings, and reading what a run wrote."""

import json
import os
import re
import shutil
import subprocess
import sys

from tupe_ds.distributed import launchers
from tupe_ds.train.checkpoint import history
from tupe_ds.tools.third_party_warnings import nvidia_gpus_present

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
EXIT_WORKER = os.path.join(ROOT, "tests", "support", "exit_worker.py")


def free_port() -> str:
    return str(launchers.free_port())


def command(launcher, processes, data, out, *flags):
    """tupe-pretrain under a launcher (None: one process without one, as typed), through
    tests/support/exit_worker.py: every rank must also leave no process group behind (else its
    exit code is 3)."""
    flags = ["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out),
             "--seq-len", "64", "--log-interval", "1", "--eval-samples", "32", *flags]
    if launcher is None:
        assert processes == 1, "without a launcher, one process"
        return [sys.executable, EXIT_WORKER, "pretrain", *flags]
    if launcher == "deepspeed":
        return [os.path.join(BIN, "deepspeed"), "--num_gpus", str(processes), "--master_port",
                free_port(), EXIT_WORKER, "pretrain", *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", free_port(), EXIT_WORKER, "pretrain", *flags]


def environment():
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   os.path.join(ROOT, "build", "torch_extensions"))}


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def train(launcher, processes, data, out, *flags, timeout=400):
    env = environment()
    if launcher is None:  # not the variables of a launcher the test process was started by
        env = {name: value for name, value in env.items() if name not in LAUNCHER_VARIABLES}
    result = subprocess.run(command(launcher, processes, data, out, *flags), env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def log(out):
    """{step: entry} of a run's train_log.jsonl; a step logged twice keeps its last entry."""
    entries = {}
    with open(os.path.join(out, "train_log.jsonl")) as f:
        for line in f:
            entry = json.loads(line)
            entries.setdefault(entry["step"], {}).update(entry)
    return entries


def losses(out):
    return {step: e["train/loss"] for step, e in log(out).items() if "train/loss" in e}


def shipped_config_in_fp32(name, tmp_path):
    """A shipped GPU config with fp16 off, which DeepSpeed refuses on a CPU; everything else
    (ZeRO stage and options, micro-batch, optimizer) as shipped."""
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        config = json.load(f)
    config["fp16"]["enabled"] = False
    path = tmp_path / f"{name}.fp32.json"
    path.write_text(json.dumps(config))
    return str(path)


def assert_quiet(output: str) -> None:
    """No line of DeepSpeed's or its launcher's logs, no Python warning
    (tupe_ds/tools/third_party_warnings.py), but for DeepSpeed's "Setting accelerator to CPU"
    where NVIDIA GPUs exist (hidden from the suite) and CUDA was not found."""
    noise = [line for line in output.splitlines()
             if re.search(r"\[(INFO|WARNING)\]|Warning: |hostfile", line)
             and not ("Setting accelerator to CPU" in line and nvidia_gpus_present())]
    assert not noise, "\n".join(noise[:20])


def cut_back_to(run, copy, step):
    """A copy of a finished run whose latest checkpoint is `step`, as if it had stopped there."""
    shutil.copytree(run, copy)
    checkpoints = copy / "checkpoints"
    for name in os.listdir(checkpoints):
        if name.startswith("step") and int(name[4:]) > step:
            shutil.rmtree(checkpoints / name)
    (checkpoints / "latest").write_text(f"step{step}")
    records = history.read(str(copy))  # as it was when `step` was committed
    last = max(i for i, r in enumerate(records) if r["kind"] == "committed" and r["step"] == step)
    os.remove(copy / history.FILE)
    history.append(str(copy), [], records[:last + 1])
    with open(copy / "train_log.jsonl") as f:
        kept = [line for line in f if json.loads(line)["step"] <= step]
    (copy / "train_log.jsonl").write_text("".join(kept))
    return copy
