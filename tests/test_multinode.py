"""Two nodes on one machine: a Slurm cluster whose controller and nodes n1, n2 are network
namespaces of their own (tests/slurm_cluster.py: Network, SlurmCluster), with real sockets between
them. Through the real sbatch script and torchrun, ranks on both nodes train over gloo on the
192.0.2.0/24 addresses and write into one checkpoint folder; the losses and the exported weights
equal one process's (fp32, same seed, dropout off). Skipped, with the reason, where network
namespaces or Slurm cannot be had (they need root)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from slurm_cluster import Network, SlurmCluster, install_packages
from test_pretrain import ROOT, environment, free_port, log, train
from test_slurm import TINY, logged_steps

STEPS = 80  # about 6 s of training on two nodes: time for a signal to land midway
FLAGS = ["--steps", str(STEPS), "--global-batch", "32", "--dropout", "0", "--lr", "2e-3",
         "--warmup-steps", "2", "--eval-interval", str(STEPS)]
NODES = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
         "--time=30", "--mem=1G"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    reason = Network.unavailable() or install_packages()
    if reason:
        pytest.skip(f"no two-node cluster here: {reason}")
    network = Network({"ctl": 100, "n1": 101, "n2": 102})
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-2-nodes"), network)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        network.remove()


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The reference: the same run in one process (micro-batch 8 x 4 accumulation)."""
    out = tmp_path_factory.mktemp("one-process") / "run"
    train("torchrun", 1, data, out, *FLAGS)
    return out


def submit(cluster, data, out, *flags, env=None):
    """slurm/pretrain.sbatch on both nodes, 2 tasks each."""
    env = {**environment(), "PYTHON": sys.executable, **(env or {})}
    return cluster.sbatch(*NODES, f"--output={out}.log", f"--chdir={ROOT}",
                          os.path.join(ROOT, "slurm", "pretrain.sbatch"), "bert-large", data,
                          str(out), *TINY, *FLAGS, *flags, env=env)


def finished(cluster, job_id, out):
    job = cluster.wait_until_done(job_id)
    output = open(f"{out}.log").read()
    assert job["JobState"] == "COMPLETED", output[-4000:] + cluster.logs()
    return output


def exported_weights(run, out):
    from tupe_ds.export import export

    export(str(run), str(out))
    return load_file(os.path.join(out, "model.safetensors"))


def assert_trains_like_one_process(run, reference, tmp_path):
    mine, theirs = log(run), log(reference)
    assert sorted(s for s in mine if "train/loss" in mine[s]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # the gradient norm, a sum of squares, drifts the most:
        # other reduction orders leave the loss within 5e-7 at every step and the norm within
        # 1e-5, except at a few steps whose gradients cancel (seen here: 3e-4 at step 38 of the
        # batches since issue 21, then back to 1e-5); a lost or doubled micro-batch moves it by percents
        for name, tolerance in (("train/loss", 1e-5), ("train/grad_norm", 1e-3)):
            assert mine[step][name] == pytest.approx(theirs[step][name], rel=tolerance), (
                step, name)
    assert mine[STEPS]["valid/loss"] == pytest.approx(theirs[STEPS]["valid/loss"], rel=1e-5)
    weights = exported_weights(run, tmp_path / "export-run")
    expected = exported_weights(reference, tmp_path / "export-reference")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():  # one Adam step moves a weight by up to lr = 2e-3;
        # 80 of them in another reduction order leave up to 1.5e-6 (seen here, tp=2)
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


def tasks_on(cluster, node):
    """PIDs of tupe-pretrain's processes on `node`."""
    pids = []
    for pid in cluster.network.pids(node):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tupe_ds.pretrain" in f.read():
                    pids.append(pid)
        except FileNotFoundError:
            continue
    return pids


def test_sbatch_on_two_nodes_preempted_and_requeued_trains_like_one_process(
        two_nodes, data, one_process, tmp_path):
    """dp=4 across the nodes; SIGUSR1 (Slurm's warning before the time limit) midway: every
    rank on both nodes saves and stops, the job requeues itself and finishes where it was."""
    out = tmp_path / "run"
    job_id = submit(two_nodes, data, out, "--save-interval", "1000")
    two_nodes.wait(job_id, lambda job: os.path.exists(out / "train_log.jsonl")
                   and len(logged_steps(out)) >= 3)
    two_nodes.run("scancel", "--batch", "--signal=USR1", job_id)
    two_nodes.wait(job_id, lambda job: job["Restarts"] == "1" and job["JobState"] == "PENDING")
    two_nodes.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+2")  # test_slurm.py
    output = finished(two_nodes, job_id, out)
    assert "4 tasks on n[1-2]" in output
    assert "4 processes from srun (tp 1, pp 1, dp 4)" in output
    stopped = int(output.split("stopping at step ")[1].split()[0])
    assert 3 <= stopped < STEPS and f"resumed at step {stopped} of {STEPS}" in output
    assert logged_steps(out) == list(range(1, STEPS + 1))  # nothing lost, nothing twice
    for node in ("n1", "n2"):  # both slurmds ran tasks of the step, both times
        assert open(two_nodes.root / f"slurmd.{node}.log").read().count(
            f"launch task StepId={job_id}.0") == 2, node
    assert_trains_like_one_process(out, one_process, tmp_path)


def test_node_killed_mid_save_resumes_from_the_previous_checkpoint(two_nodes, data, one_process,
                                                                    tmp_path):
    """tp=2 inside each node and dp=2 across them. Node 2's tasks are frozen while a checkpoint
    is being written, before they wrote their files (node 1's ranks say what they wait for),
    then killed: `latest` stays on the previous checkpoint, and the same sbatch command resumes
    from it and ends like one process."""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    job_id = submit(two_nodes, data, out, "--tp", "2", "--save-interval", "2",
                    env={"TUPE_DS_WAIT_NOTICE": "1"})
    deadline = time.time() + 300
    while True:  # catch a save in which node 2's ranks (2 and 3) have not written yet
        assert time.time() < deadline, "no save caught in flight"
        saving = sorted(int(n[4:]) for n in os.listdir(checkpoints) if n[4:].isdigit()) \
            if checkpoints.is_dir() else []
        if saving and saving[-1] >= 4 and not (checkpoints / f"step{saving[-1]}" /
                                                 "rng_rank2.pt").exists():
            node2 = tasks_on(two_nodes, "n2")
            for pid in node2:
                os.kill(pid, signal.SIGSTOP)
            step_dir = checkpoints / f"step{saving[-1]}"
            if step_dir.exists() and not any((step_dir / f"rng_rank{r}.pt").exists()
                                             for r in (2, 3)):
                break
            for pid in node2:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    time.sleep(2.5)
    latest_before = (checkpoints / "latest").read_text()
    for pid in node2:
        os.kill(pid, signal.SIGKILL)
    job = two_nodes.wait_until_done(job_id)
    assert job["JobState"] == "FAILED"
    assert (checkpoints / "latest").read_text() == latest_before == f"step{saving[-1] - 2}"
    assert not (checkpoints / f"step{saving[-1]}" / "manifest.json").exists()
    killed = open(f"{out}.log").read()
    # Node 2 stopped before its random states: before or after DeepSpeed's files (its shards
    # come first, within milliseconds), so node 1 waits in DeepSpeed's save or in the checksums.
    assert re.search(f"tupe-pretrain rank 0: waiting 1 s for every rank to (write|checksum its "
                     f"files of) checkpoint step{saving[-1]}\\b", killed), killed[-3000:]
    output = finished(two_nodes, submit(two_nodes, data, out, "--tp", "2", "--save-interval", "2"),
                      out)
    assert f"resumed at step {saving[-1] - 2} of {STEPS}" in output.split("stopping")[-1]
    assert f"step{saving[-1]} (newer than step{saving[-1] - 2}" in output  # set aside, kept
    assert "4 processes from srun (tp 2, pp 1, dp 2)" in output
    assert_trains_like_one_process(out, one_process, tmp_path)


def test_torchrun_on_two_nodes_with_the_rendezvous_on_node_1(two_nodes, data, one_process,
                                                              tmp_path):
    """One torchrun per node (c10d rendezvous at n1's address, --local-addr as on nodes whose
    hostname does not resolve to the interface the others reach them on)."""
    network, out, port = two_nodes.network, tmp_path / "run", free_port()
    runs = []
    for node in ("n1", "n2"):
        command = [*network.prefix(node), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{network.addresses['n1']}:{port}", "--rdzv-id", "tupe",
                   "--local-addr", network.addresses[node], "-m", "tupe_ds.pretrain",
                   "--data", data, "--out", str(out), *TINY, *FLAGS]
        runs.append(subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))
    outputs = [run.communicate(timeout=400)[0] for run in runs]
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-4000:]
    assert "2 processes from deepspeed or torchrun (tp 1, pp 1, dp 2)" in "".join(outputs)
    with open(out / "run.json") as f:
        assert json.load(f)["tp"] == 1
    assert_trains_like_one_process(out, one_process, tmp_path)
