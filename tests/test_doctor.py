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
from tupe_ds.tools.errors import Refused
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


def test_doctor_command_on_this_machine(capsys, tmp_path):
    assert doctor.main(["--ds-config", CPU_CONFIG]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "deepspeed " in out and "megatron-core " in out
    assert doctor.main(["--ds-config", FP16_CONFIG]) == 1  # this machine has no CUDA
    assert "ERROR: " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):  # a count, as tupe-smoke's --steps --batch --seq
        doctor.main(["--nproc", "-3"])
    assert "tupe-doctor: error: argument --nproc: -3: at least 1" in capsys.readouterr().err
    from tupe_ds.machine import smoke
    for flag in ("--steps", "--batch", "--seq"):
        with pytest.raises(SystemExit, match="2"):
            smoke.main([flag, "0"])
        assert f"tupe-smoke: error: argument {flag}: 0: at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        smoke.main(["--lr", "nan"])
    assert "tupe-smoke: error: --lr nan: a learning rate is a positive" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[]")  # tupe-pretrain's reader: test_run_config.py
    assert doctor.main(["--ds-config", str(tmp_path / "list.json")]) == 2
    assert capsys.readouterr().err == (f"tupe-doctor: error: --ds-config {tmp_path}/list.json: a "
                                       "DeepSpeed config is a JSON object ({...}), not []\n")


def test_pretraining_config_fails_before_work_on_the_wrong_hardware(data, tmp_path, monkeypatch):
    flags = ["--data", data, "--out", str(tmp_path / "run"), "--steps", "5", "--model", "tiny"]
    with pytest.raises(Refused, match="enables bf16, which needs GPUs of compute capability"):
        load([*flags, "--ds-config", BF16_CONFIG], world_size=1, machine=gpus(1, VOLTA))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node 4 on a 2-GPU node
    with pytest.raises(Refused, match="4 processes on this machine, but it has 2 GPU"):
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


def test_check_only_lists_what_is_where_above_a_refusal(data, tmp_path, monkeypatch, capsys):
    """A folder a start refuses (here: no history, a step folder without a manifest): its
    listing first, then the refusal, exit code 2, nothing written."""
    from tupe_ds.pretrain import main as pretrain

    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "run" / "checkpoints" / "step4").mkdir(parents=True)
    before = sorted(os.listdir(tmp_path / "run"))
    assert pretrain(["--data", data, "--out", str(tmp_path / "run"), "--steps", "5", "--model",
                     "tiny", "--ds-config", CPU_CONFIG, "--check-only"]) == 2
    printed = capsys.readouterr()
    assert "step4: incomplete (no manifest.json: a save cut short)" in printed.out
    assert "history.jsonl is not there (or empty)" in printed.err
    assert sorted(os.listdir(tmp_path / "run")) == before


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
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("32768\t60999\n")
    lines, found = slurm_report(allocation, "nccl", f"{tmp_path}/home/data",
                                f"{tmp_path}/home/run", mounts=str(mounts), port_range=str(ports))
    assert found == []
    assert "rendezvous: gpu07:20077; backend nccl" in lines
    assert "network: NCCL_SOCKET_IFNAME=ib0" in lines
    assert "CPUs per task: 8 (the step gets 8 through slurm/srun_requeue.sh)" in lines
    planted = {**allocation, "MASTER_PORT": "40000", "TORCH_EXTENSIONS_DIR": f"{tmp_path}/home/x"}
    del planted["SLURM_CPUS_PER_TASK"]
    _, found = slurm_report(planted, "nccl", f"{tmp_path}/data", f"{tmp_path}/run",
                            mounts=str(mounts), port_range=str(ports))
    texts = [f.text for f in found]
    assert texts[0].startswith("no --cpus-per-task in this job: ")
    assert texts[1] == (f"MASTER_PORT=40000 is in this node's ephemeral port range (32768-60999, "
                        f"{ports}), where another process may hold it; set MASTER_PORT to a "
                        "free port below 32768")
    assert "on a nfs4 filesystem every node shares" in texts[2]
    assert texts[3].startswith(f"--out {tmp_path}/run is on a filesystem of this node (ext4), "
                               "which other nodes do not see: every rank writes its checkpoint")
    assert texts[4].startswith(f"--data {tmp_path}/data is on a filesystem of this node (ext4)")
    assert [f.fatal for f in found] == [False, False, False, True, False]
    lines, found = slurm_report({}, "gloo", None, None)
    assert lines == [] and found[0].fatal and "no Slurm allocation here" in found[0].text


def test_doctor_reads_this_nodes_ephemeral_port_range(tmp_path):
    """The job's own port (20000 + job id mod 12768) is flagged where the node's range starts
    lower than Linux's default; the default where the file cannot be read."""
    from tupe_ds.machine.cluster_check import slurm_report

    allocation = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu07", "SLURM_CPUS_PER_TASK": "8"}
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("15000 60999\n")
    _, found = slurm_report(allocation, "nccl", None, None, port_range=str(ports))
    assert [f.text.split(",")[0] for f in found] == [
        "MASTER_PORT=20077 is in this node's ephemeral port range (15000-60999"]
    _, found = slurm_report({**allocation, "MASTER_PORT": "32768"}, "nccl", None, None,
                            port_range=str(tmp_path / "none"))
    assert [f.text.split(",")[0] for f in found] == [
        "MASTER_PORT=32768 is in this node's ephemeral port range (32768-60999"]


SHARED = ("lustre", "gpfs", "nfs", "nfs4", "beegfs", "ceph", "fuse.ceph-fuse", "dvs", "wekafs",
          "gfs2", "ocfs2", "pvfs2")  # pvfs2: OrangeFS


@pytest.mark.parametrize("kind", SHARED)
def test_doctor_knows_the_shared_filesystems(tmp_path, kind):
    """A run folder on a filesystem every node mounts is no finding on two nodes; one on a
    node's own disk is an error; one of a type it does not know, a warning."""
    from tupe_ds.machine.cluster_check import slurm_report

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/x {tmp_path}/shared {kind} rw 0 0\n"
                      f"mystery {tmp_path}/odd fuse.mystery rw 0 0\n")
    allocation = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "8",
                  "TORCH_EXTENSIONS_DIR": f"{tmp_path}/local/ext"}
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("32768 60999\n")
    lines, found = slurm_report(allocation, "nccl", f"{tmp_path}/shared/data",
                                f"{tmp_path}/shared/run", mounts=str(mounts), port_range=str(ports))
    assert found == [] and f"--out {tmp_path}/shared/run: {kind}; locks: flock" in lines
    _, found = slurm_report(allocation, "nccl", f"{tmp_path}/odd/data", f"{tmp_path}/run",
                            mounts=str(mounts), port_range=str(ports))
    assert [(f.fatal, f.text.split(":")[0]) for f in found] == [
        (True, f"--out {tmp_path}/run is on a filesystem of this node (ext4), which other nodes "
               "do not see"),
        (False, f"--data {tmp_path}/odd/data is on a filesystem tupe-doctor does not know "
                "(fuse.mystery)")]


def test_doctor_says_which_lock_a_run_takes_in_its_folders(tmp_path, monkeypatch):
    """flock where it works, else the lock files made by hard links; a filesystem without hard
    links is an error for --out (run.lock is one), and for the index cache without flock."""
    import errno
    import fcntl

    from tupe_ds.machine.cluster_check import slurm_report

    def fails(code):
        def call(*args):
            raise OSError(code, os.strerror(code))
        return call

    allocation = {"SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "8"}
    data, out = tmp_path / "data", tmp_path / "runs" / "run"  # --out: made by the run
    data.mkdir()
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("32768 60999\n")

    def report():
        lines, found = slurm_report(allocation, "nccl", str(data), str(out),
                                    port_range=str(ports))
        return [line.split("; ", 1)[1] for line in lines if line.startswith("--")], found

    assert report() == (["locks: flock"] * 2, [])
    monkeypatch.setattr(fcntl, "flock", fails(errno.ENOSYS))
    assert report() == (["locks: lock files (NAME.lock.holder, as flock fails here: Function not "
                         "implemented)"] * 2, [])
    monkeypatch.setattr(os, "link", fails(errno.EPERM))
    locks, found = report()
    assert locks == ["locks: none"] * 2 and [f.fatal for f in found] == [True, True]
    assert found[0].text.startswith(f"--out {out}: hard links fail here (Operation not "
                                    "permitted), and OUT/run.lock is made by one")
    assert found[1].text == (f"--data {data}: neither flock (Function not implemented) nor hard "
                             "links (Operation not permitted) work here, so the index cache "
                             "cannot lock: give --index-cache a folder on another filesystem")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["data", ports.name] and os.listdir(data) == []
