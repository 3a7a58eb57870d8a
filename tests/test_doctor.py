"""A GPU user's first hour, on a CPU: the demo's choice of GPUs and precision, the environment
check's findings, and the errors a newcomer meets, with fake device counts and capabilities."""

import json
import os

import pytest

from runs import CPU_CONFIG, ROOT
from tupe_ds.demo.run import demo_launch
from tupe_ds.distributed import launch
from tupe_ds.finetune.run import main as finetune
from tupe_ds.machine import doctor
from tupe_ds.train.config import load

HOPPER, AMPERE, VOLTA, KEPLER = (9, 0), (8, 0), (7, 0), (3, 7)
FP16_CONFIG = os.path.join(ROOT, "ds_configs", "bert_large_fp16.json")
BF16_CONFIG = os.path.join(ROOT, "ds_configs", "demo_bf16.json")


def gpus(count, capability=HOPPER):
    return doctor.Machine(accelerator="cuda", gpus=count, capabilities=(capability,) * count,
                          versions={"torch": "2.13.0"})


CPU = doctor.Machine(accelerator="cpu", gpus=0)


@pytest.mark.parametrize("machine, expected", [
    (CPU, (2, doctor.CPU_CONFIG)),
    (gpus(1), (1, "ds_configs/demo_bf16.json")),
    (gpus(4, AMPERE), (4, "ds_configs/demo_bf16.json")),
    (gpus(8, VOLTA), (8, "ds_configs/demo_fp16.json")),  # V100: no bf16
    (gpus(16), (8, "ds_configs/demo_bf16.json")),
    (gpus(2, KEPLER), (2, doctor.CPU_CONFIG)),  # neither half precision: fp32
    (doctor.Machine("cpu", gpus=2, capabilities=(HOPPER, HOPPER)), (2, doctor.CPU_CONFIG)),
])
def test_the_demo_uses_the_gpus_it_finds_in_a_precision_they_have(machine, expected):
    processes, config, _ = demo_launch(machine)
    assert (processes, config) == expected
    assert os.path.exists(os.path.join(ROOT, config))
    with open(os.path.join(ROOT, config)) as f:
        dtype = doctor.precision(json.load(f))
    assert machine.supports(dtype) or machine.accelerator != "cuda" and dtype == "fp32"


def test_mixed_gpus_train_in_what_all_of_them_have():
    mixed = doctor.Machine("cuda", gpus=2, capabilities=(HOPPER, VOLTA))
    assert mixed.half_precision == "fp16" and not mixed.supports("bf16")


def findings(machine, config=None, processes=None, **environ):
    return [f.text for f in doctor.all_findings(machine, config, processes, environ)]


def test_precision_the_hardware_lacks_is_an_error_with_the_fix():
    (text,) = findings(gpus(8, VOLTA), BF16_CONFIG)
    assert "enables bf16, which needs GPUs of compute capability 8.0 or newer; these have 7.0" \
        in text
    assert '"fp16": {"enabled": true}' in text
    (text,) = findings(gpus(1, KEPLER), FP16_CONFIG)
    assert "enables fp16, which needs GPUs of compute capability 6.0" in text and "fp32" in text
    (text,) = findings(CPU, FP16_CONFIG)
    assert "DeepSpeed refuses without CUDA; on a CPU use ds_configs/cpu_zero2.json" in text
    assert findings(gpus(8), FP16_CONFIG) == [] and findings(CPU, CPU_CONFIG) == []


def test_more_processes_than_gpus_is_an_error_naming_the_count():
    (text,) = findings(gpus(2), processes=4)
    assert "4 processes on this machine, but it has 2 GPU(s): start 2 (deepspeed --num_gpus 2" \
        in text
    assert findings(gpus(2), processes=2) == [] and findings(CPU, processes=4) == []


def test_optimizer_that_needs_a_compiler(tmp_path, monkeypatch):
    config = tmp_path / "adam.json"
    config.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}))
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    (fatal,) = doctor.all_findings(gpus(1), str(config), None, {"CUDA_HOME": str(tmp_path)})
    assert fatal.fatal and "there is no nvcc here" in fatal.text
    assert '"torch_adam": true' in fatal.text
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    (warning,) = doctor.all_findings(gpus(1), str(config), None, {"CUDA_HOME": str(tmp_path)})
    assert not warning.fatal and "compiled by DeepSpeed on first use" in warning.text
    assert findings(gpus(1), FP16_CONFIG, CUDA_HOME=str(tmp_path)) == []  # torch's fused AdamW
    assert findings(CPU, str(config)) == []  # DeepSpeed's CPU Adam is not this


def test_environment_traps_are_named_with_their_fix():
    (text,) = findings(gpus(1), TORCH_CUDA_ARCH_LIST="8.0;9.0a+PTX")
    assert "TORCH_CUDA_ARCH_LIST='8.0;9.0a+PTX'" in text and "'8.0;9.0+PTX'" in text
    assert findings(gpus(1), TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX") == []
    (text,) = findings(doctor.Machine("cpu", gpus=0), CUDA_VISIBLE_DEVICES="")
    assert "CUDA_VISIBLE_DEVICES is set but empty" in text
    (text,) = findings(doctor.Machine("cpu", gpus=2, capabilities=(HOPPER, HOPPER)),
                       DS_ACCELERATOR="cpu")
    assert "DeepSpeed will train on the CPU; unset DS_ACCELERATOR" in text
    (text,) = findings(doctor.Machine("cuda", gpus=0))
    assert "torch sees no GPU" in text


def test_report_lists_the_machine_versions_and_findings():
    machine = gpus(2, AMPERE)
    text = doctor.report(machine, doctor.all_findings(machine, BF16_CONFIG, 4, {}))
    assert "accelerator cuda: 2 GPU(s), compute capability 8.0, 8.0; half precision here: bf16" \
        in text
    assert "torch 2.13.0" in text and "ERROR: 4 processes on this machine" in text
    assert "no problem found" in doctor.report(machine, [])


def test_doctor_command_on_this_machine(capsys):
    assert doctor.main(["--ds-config", CPU_CONFIG]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "deepspeed " in out and "megatron-core " in out
    assert doctor.main(["--ds-config", FP16_CONFIG]) == 1  # this machine has no CUDA
    assert "ERROR: " in capsys.readouterr().out


def test_pretraining_config_fails_before_work_on_the_wrong_hardware(data, tmp_path, monkeypatch):
    flags = ["--data", data, "--out", str(tmp_path / "run"), "--steps", "5", "--model", "tiny"]
    with pytest.raises(SystemExit, match="enables bf16, which needs GPUs of compute capability"):
        load([*flags, "--ds-config", BF16_CONFIG], world_size=1, machine=gpus(1, VOLTA))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node 4 on a 2-GPU node
    with pytest.raises(SystemExit, match="4 processes on this machine, but it has 2 GPU"):
        load([*flags, "--ds-config", FP16_CONFIG], world_size=4, machine=gpus(2))
    assert load([*flags, "--ds-config", BF16_CONFIG], world_size=4, machine=gpus(4)).models
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("environ, expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"LOCAL_SIZE": "8"}, 8),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2), ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8), ({}, 1)])
def test_processes_on_this_node_from_every_launcher(environ, expected):
    assert launch.processes_on_this_node(environ) == expected


def test_finetune_on_a_folder_that_is_not_an_export_names_tupe_export(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    flags = ["--task", "sst2", "--train", str(tmp_path / "train.tsv"), "--valid",
             str(tmp_path / "train.tsv"), "--out", str(tmp_path / "out")]
    assert finetune(["--model", str(run), *flags]) == 2
    assert (f"{run} is a tupe-pretrain run, not an exported model: run tupe-export {run} --out "
            "EXPORT_DIR") in capsys.readouterr().err
    assert finetune(["--model", str(tmp_path), *flags]) == 2
    assert "not a tupe-export folder (no config.json); tupe-export RUN_DIR --out DIR" in \
        capsys.readouterr().err
    assert finetune(["--model", str(tmp_path / "missing"), *flags]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_check_only_prints_the_machine_report_then_the_layout(data, tmp_path, monkeypatch, capsys):
    from tupe_ds.pretrain import main as pretrain

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert pretrain(["--data", data, "--out", str(tmp_path / "run"), "--steps", "5", "--model",
                     "tiny", "--ds-config", CPU_CONFIG, "--check-only"]) == 0
    out = capsys.readouterr().out
    assert "accelerator cpu: no GPU" in out and "megatron-core " in out
    assert "warning: TORCH_CUDA_ARCH_LIST='9.0a'" in out
    assert "configuration OK for 2 processes (tp 1, pp 1, dp 2)" in out
    assert not (tmp_path / "run").exists()


def test_doctor_for_a_slurm_job_names_each_problem_with_its_fix(tmp_path):
    """One problem planted per check: a port in the ephemeral range, the extension builds on a
    shared filesystem, --out and --data on a node's own disk; and no allocation at all."""
    from tupe_ds.machine.cluster_check import slurm_report

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home {tmp_path}/home nfs4 rw 0 0\n")
    allocation = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "16",
                  "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
                  "SLURM_CPUS_PER_TASK": "8", "NCCL_SOCKET_IFNAME": "ib0",
                  "TORCH_EXTENSIONS_DIR": f"{tmp_path}/local/ext"}
    lines, found = slurm_report(allocation, "nccl", f"{tmp_path}/home/data",
                                f"{tmp_path}/home/run", mounts=str(mounts))
    assert found == []
    assert "rendezvous: gpu07:20077; backend nccl" in lines
    assert "network: NCCL_SOCKET_IFNAME=ib0" in lines
    assert "CPUs per task: 8 (the step gets 8 through slurm/srun_requeue.sh)" in lines
    planted = {**allocation, "MASTER_PORT": "40000", "TORCH_EXTENSIONS_DIR": f"{tmp_path}/home/x"}
    del planted["SLURM_CPUS_PER_TASK"]
    _, found = slurm_report(planted, "nccl", f"{tmp_path}/data", f"{tmp_path}/run",
                            mounts=str(mounts))
    texts = [f.text for f in found]
    assert texts[0].startswith("no --cpus-per-task in this job: ")
    assert "MASTER_PORT=40000 is in Linux's ephemeral range" in texts[1]
    assert "on a nfs4 filesystem every node shares" in texts[2]
    assert texts[3].startswith(f"--out {tmp_path}/run is on a filesystem of this node (ext4), "
                               "which other nodes do not see: every rank writes its checkpoint")
    assert texts[4].startswith(f"--data {tmp_path}/data is on a filesystem of this node (ext4)")
    assert [f.fatal for f in found] == [False, False, False, True, False]
    lines, found = slurm_report({}, "gloo", None, None)
    assert lines == [] and found[0].fatal and "no Slurm allocation here" in found[0].text
