"""Two nodes on one machine: a Slurm cluster whose controller and nodes n1, n2 are network
namespaces of their own (tests/support/slurm_cluster.py: Network, SlurmCluster), with real sockets between
them. Through the real sbatch script and torchrun, ranks on both nodes train over gloo on the
192.0.2.0/24 addresses and write into one checkpoint folder; the losses and the exported weights
equal one process's (fp32, same seed, dropout off). The nodes bind each task to its CPUs
(TaskPlugin=task/affinity); where a test needs nodes that differ as machines do, its processes
also get a hostname and process IDs of their own (`as_host`). Skipped, with the reason, where
network namespaces or Slurm cannot be had (they need root)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from runs import ROOT, environment, free_port, log, train
import slurm_cluster
from slurm_cluster import Network, SlurmCluster, install_packages
from test_index_cache import index_files, write_corpus
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
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-2-nodes"), network,
                               task_plugin="task/affinity")
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
    train(None, 1, data, out, *FLAGS)
    return out


FAULT_WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")


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
    from tupe_ds.export.write import export

    export(str(run), str(out))
    return load_file(os.path.join(out, "model.safetensors"))


def assert_trains_like_one_process(run, reference, tmp_path):
    mine, theirs = log(run), log(reference)
    assert sorted(s for s in mine if "train/loss" in mine[s]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # the gradient norm, a sum of squares, drifts the most:
        # other reduction orders leave the loss within 5e-7 at every step and the norm within
        # 1e-5, except at a few steps whose gradients cancel (seen here: 3e-4 at step 38 of the
        # batches since issue 21; 1.3e-3 at step 39 of the corpus as issue 68 cleans it, the
        # loss within 1e-5 there); a lost or doubled micro-batch moves it by percents
        for name, tolerance in (("train/loss", 1e-5), ("train/grad_norm", 3e-3)):
            assert mine[step][name] == pytest.approx(theirs[step][name], rel=tolerance), (
                step, name)
    assert mine[STEPS]["valid/loss"] == pytest.approx(theirs[STEPS]["valid/loss"], rel=1e-5)
    weights = exported_weights(run, tmp_path / "export-run")
    expected = exported_weights(reference, tmp_path / "export-reference")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():  # one Adam step moves a weight by up to lr = 2e-3;
        # 80 of them in another reduction order leave up to 1.5e-6 (seen here, tp=2), and 1.9e-5
        # where a clipped step's norm differs by 1.3e-3 (step 39 of the corpus as issue 68
        # cleans it: every weight's update of that step scaled alike)
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=5e-5, msg=name)


def as_host(network, node):
    """The prefix that runs a program on `node` as on a machine of its own: in its network
    namespace, with the hostname `node` and process IDs of its own (the program is PID 1)."""
    return [*network.prefix(node), "unshare", "--uts", "--pid", "--fork", "sh", "-c",
            'hostname "$0" && exec "$@"', node]


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


@pytest.mark.slow
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
    two_nodes.start_requeued(job_id)
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_torchrun_on_two_nodes_with_the_rendezvous_on_node_1(two_nodes, data, one_process,
                                                              tmp_path):
    """One torchrun per node (c10d rendezvous at n1's address, --local-addr as on nodes whose
    hostname does not resolve to the interface the others reach them on)."""
    network, out, port = two_nodes.network, tmp_path / "run", free_port()
    cache = tmp_path / "index-cache"  # the lock made node-local: rank 0 alone builds
    runs = []
    for node in ("n1", "n2"):
        command = [*as_host(network, node), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{network.addresses['n1']}:{port}", "--rdzv-id", "tupe",
                   "--local-addr", network.addresses[node], FAULT_WORKER, "pretrain",
                   "--data", data, "--out", str(out), "--index-cache", str(cache), *TINY, *FLAGS]
        runs.append(subprocess.Popen(command, env={**environment(),
                                                   "TUPE_DS_FAULT": "node-local-locks"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [run.communicate(timeout=400)[0] for run in runs]
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-4000:]
    assert "2 processes from torchrun (tp 1, pp 1, dp 2)" in "".join(outputs)
    built = re.findall(r"built the sample index of (\S+)", "".join(outputs))
    assert sorted(built) == [os.path.join(data, "train"), os.path.join(data, "valid")], built
    assert len(index_files(cache)) == 2 and not [n for n in os.listdir(cache) if ".tmp" in n]
    with open(out / "run.json") as f:
        assert json.load(f)["tp"] == 1
    assert_trains_like_one_process(out, one_process, tmp_path)


BUILDER = textwrap.dedent("""
    import json, os, socket, sys, time, types
    import tupe_ds.data.packing as packing
    import tupe_ds.tools.files as files
    from tupe_ds.tools import log_lines
    log_lines.show(rank=0)  # the lines a command shows
    prefix, cache, ready = sys.argv[1:]
    files.fcntl = types.SimpleNamespace(  # a lock that holds on this node only
        flock=lambda handle, operation: None, LOCK_EX=0, LOCK_UN=0)
    real_pack = packing.pack
    def slow_pack(*args):
        print("building", flush=True)
        time.sleep(2)
        return real_pack(*args)
    packing.pack = slow_pack
    open(os.path.join(ready, socket.gethostname()), "w").close()
    while len(os.listdir(ready)) < 2:  # both start at once
        time.sleep(0.01)
    packed = packing.PackedSentences(prefix, 32, 2, 3, cache)
    with open("/proc/self/maps") as maps:
        inodes = {int(line.split()[4]) for line in maps if packed.index_path in line}
    print(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "samples": len(packed),
                      "inodes": sorted(inodes)}), flush=True)
""")


@pytest.mark.slow
def test_two_nodes_without_a_shared_lock_both_build_and_map_the_first_copy(two_nodes, tmp_path):
    """Two processes outside any process group (as tools open data) on n1 and n2, each PID 1 of
    its node, whose cache lock holds per node: both build the index at once, neither deletes
    or replaces the other's file, and both map the one copy that stays."""
    prefix, cache, ready = str(tmp_path / "corpus"), tmp_path / "cache", tmp_path / "ready"
    write_corpus(prefix, seed=0)
    ready.mkdir()
    builders = [subprocess.Popen([*as_host(two_nodes.network, node), sys.executable, "-c",
                                  BUILDER, prefix, str(cache), str(ready)],
                                 env=environment(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for node in ("n1", "n2")]
    outputs = [builder.communicate(timeout=120)[0] for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0], outputs
    assert [output.count("building") for output in outputs] == [1, 1], outputs
    assert sum(output.count("built the sample index") for output in outputs) == 1, outputs
    reports = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    assert [(r["host"], r["pid"]) for r in reports] == [("n1", 1), ("n2", 1)]  # names by PID
    # alone would have collided
    (index,) = index_files(cache)
    assert not [name for name in os.listdir(cache) if ".tmp" in name]
    inode = os.stat(cache / index).st_ino
    assert [r["inodes"] for r in reports] == [[inode], [inode]]
    assert reports[0]["samples"] == reports[1]["samples"] > 0


@pytest.mark.slow
def test_srun_tasks_meet_without_scontrol_on_the_cpus_the_job_asked_for(two_nodes, tmp_path):
    """A job of one task per node with --cpus-per-task 2 on nodes that bind tasks to CPUs. Its
    steps run with no scontrol on PATH (as in containers) and meet over gloo at the first node
    of the step, on the port of the job id (or MASTER_PORT). A step asked for 1 CPU per task is
    bound to 1 (the binding is real); srun_requeue's step gets the job's 2 through
    SRUN_CPUS_PER_TASK, and runs on both."""
    probe = os.path.join(ROOT, "tests", "support", "rendezvous_probe.py")
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        set -euo pipefail
        source {ROOT}/slurm/srun_requeue.sh
        MASTER_PORT=29411 srun --cpus-per-task=1 env PATH=/nonexistent "$PYTHON" {probe}
        srun_requeue env PATH=/nonexistent "$PYTHON" {probe}
        """))
    out = tmp_path / "job.log"
    job_id = two_nodes.sbatch("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                              "--gpus-per-node=0", "--time=5", "--mem=500M", f"--output={out}",
                              str(script), env={**environment(), "PYTHON": sys.executable})
    job = two_nodes.wait_until_done(job_id, timeout=120)
    output = out.read_text()
    assert job["JobState"] == "COMPLETED", output[-3000:] + two_nodes.logs()
    reports = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    one_cpu, wrapped = reports[:2], reports[2:]
    port = 20000 + int(job_id) % 12768
    for step, master, cpus, passed_on in ((one_cpu, ["n1", 29411], 1, None),
                                          (wrapped, ["n1", port], 2, "2")):
        assert sorted((r["rank"], r["node"]) for r in step) == [(0, "n1"), (1, "n2")], output
        for report in step:
            assert report["launcher"] == "srun" and report["scontrol"] is None
            assert report["master"] == master and report["sum"] == 3.0
            assert len(report["cpus"]) == cpus, (report, output)
            assert report["srun_cpus_per_task"] == passed_on


LEFT_BEHIND = """\
import sys, time
from pathlib import Path
sys.path[:0] = sys.argv[2:]
from slurm_cluster import Network, SlurmCluster
network = Network({"ctl": 100, "n1": 101})
cluster = SlurmCluster(Path(sys.argv[1]), network)
job = cluster.sbatch("--wrap", "sleep 600", "--output=/dev/null")
cluster.wait(job, lambda job: job["JobState"] == "RUNNING", timeout=60)
print(network.namespaces["ctl"], network.bridge, network.folder, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_what_a_killed_tests_cluster_left_the_next_one_removes(tmp_path):
    """A process that made a cluster (namespaces, a bridge, veths, hosts files, daemons, a job's
    step and task) and was killed without its teardown, as a SIGINT to pytest's controller alone ends
    the xdist workers: the next cluster's remove_leftovers removes all of it, and nothing of a
    process that still holds its cluster."""
    reason = Network.unavailable() or install_packages()
    if reason:
        pytest.skip(f"no cluster here: {reason}")
    root = tmp_path / "cluster"
    owner = subprocess.Popen([sys.executable, "-c", LEFT_BEHIND, str(root),
                              os.path.join(ROOT, "tests", "support"), ROOT],
                             stdout=subprocess.PIPE, text=True)
    try:
        namespace, bridge, hosts_files = owner.stdout.readline().split()
        assert slurm_cluster.remove_leftovers() == []  # its owner holds it
        assert slurm_cluster.naming(str(root)) and namespace in ip("netns", "list")
    finally:
        owner.kill()
        owner.wait()
    with pytest.warns(UserWarning, match=f"process {owner.pid}, which ended before"):
        assert len(slurm_cluster.remove_leftovers()) == 1
    deadline = time.monotonic() + 10  # slurmctld's slurmscriptd ends after it
    while slurm_cluster.naming(str(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm_cluster.naming(str(root)) == []  # daemons, the job's step and its task
    assert namespace not in ip("netns", "list") and bridge not in ip("link", "show")
    assert not os.path.exists(hosts_files)
    assert not list(slurm_cluster.RECORDS.glob(f"{owner.pid}-*"))


def ip(*arguments) -> str:
    return subprocess.run(["ip", *arguments], capture_output=True, text=True, check=True).stdout
