"""Launching everywhere: the real sbatch scripts against a real Slurm (one node on 127.0.0.1,
tests/support/slurm_cluster.py), mpirun, and how each launcher's ranks are read. Preemption and requeue,
on two nodes: test_multinode.py.

When Slurm, munge and OpenMPI cannot be installed, these tests are skipped with the reason."""

import hashlib
import json
import os
import random
import re
import socket
import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data_prep.output import LOCK
from runs import CPU_CONFIG, ROOT, environment, free_port, log
from slurm_cluster import SlurmCluster, install_packages
from test_blend import stand_in_python_and_srun
from test_compare import write_glue
from test_data_prep import near_copy, run as prep, unique_document, write_txt
from logged import logged_lines
from tupe_ds.distributed import launch, launchers

TINY = ["--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64", "--log-interval", "1",
        "--eval-samples", "32"]
SBATCH_ON_THIS_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                       "--cpus-per-task=1", "--time=30", "--mem=1G"]
# for a job whose test checks nothing of ranks (a rank's start is most of a tiny job's CPU)
ONE_TASK_ON_THIS_NODE = ["--ntasks-per-node=1" if option.startswith("--ntasks-per-node") else
                         option for option in SBATCH_ON_THIS_NODE]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_packages()
    if reason:
        pytest.skip(f"no Slurm here: {reason}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def job_environment():
    return {**environment(), "PYTHON": sys.executable}


def submit_pretraining(cluster, data, out, *flags, node=SBATCH_ON_THIS_NODE):
    return cluster.sbatch(*node, f"--output={out}.log", f"--chdir={ROOT}",
                          os.path.join(ROOT, "slurm", "pretrain.sbatch"), "bert-large", data,
                          str(out), *TINY, *flags, env=job_environment())


def logged_steps(out):
    """Every train/loss line of train_log.jsonl, in order (a step logged twice shows twice)."""
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [entry["step"] for entry in map(json.loads, f) if "train/loss" in entry]


@pytest.mark.slow
def test_sbatch_pretraining_leaves_a_checkpoint_and_tensorboard(cluster, data, tmp_path):
    out = tmp_path / "run"
    job = cluster.wait_until_done(submit_pretraining(cluster, data, out, "--steps", "6",
                                                     "--eval-interval", "6"))
    output = (tmp_path / "run.log").read_text()
    assert job["JobState"] == "COMPLETED", output[-3000:]
    assert "configuration OK for 2 processes" in output  # checked once, before the tasks
    assert "2 processes from srun (tp 1, pp 1, dp 2)" in output
    assert (out / "checkpoints" / "latest").read_text() == "step6"
    events = EventAccumulator(str(out / "tensorboard" / "tupe")).Reload()
    assert {"train/loss", "valid/loss"} <= set(events.Tags()["scalars"])
    assert logged_steps(out) == list(range(1, 7))


@pytest.mark.slow
def test_resume_from_left_in_a_requeued_job_applies_once(cluster, data, tmp_path):
    """--resume-from step2 in a job's command (pretrain.sbatch passes flags through): its first
    attempt sets the run's step4 aside, resumes step2 and writes step4 and step6 anew; requeued
    (`scontrol requeue`), the same command resumes step6, saying the flag is spent and the
    command that would apply it again, and sets nothing aside."""
    out, flags = tmp_path / "run", ["--save-interval", "2", "--eval-interval", "100"]
    first = cluster.wait_until_done(submit_pretraining(cluster, data, out, "--steps", "4", *flags,
                                                       node=ONE_TASK_ON_THIS_NODE))
    assert first["JobState"] == "COMPLETED", (tmp_path / "run.log").read_text()[-3000:]
    job_id = submit_pretraining(cluster, data, out, "--steps", "6", *flags, "--resume-from",
                                "step2", "--allow-training-changes", node=ONE_TASK_ON_THIS_NODE)
    assert cluster.wait_until_done(job_id)["JobState"] == "COMPLETED"
    cluster.run("scontrol", "requeue", job_id)
    cluster.start_requeued(job_id)
    job = cluster.wait(job_id, lambda job: job["Restarts"] == "1"
                       and job["JobState"] == "COMPLETED")
    output = (tmp_path / "run.log").read_text().split(f"job {job_id} (restart 1)")[-1]
    assert job["JobState"] == "COMPLETED", output[-3000:]
    assert "tupe-pretrain: --resume-from step2 was spent by an earlier attempt" in output
    assert ": not applied again. To apply it to the run as it is now: --resume-from step2 " \
           "--giving-up " in output
    assert "resumed at step 6 of 6" in output and "moved to" not in output
    set_aside = list((out / "checkpoints" / "set-aside").glob("*/*"))
    assert [path.name for path in set_aside] == ["step4"]  # the first attempt's, once
    assert logged_steps(out) == list(range(1, 7))


@pytest.mark.slow
def test_a_wrong_layout_fails_the_job_before_any_task_starts(cluster, data, tmp_path):
    job = cluster.wait_until_done(submit_pretraining(cluster, data, tmp_path / "run", "--steps",
                                                     "6", "--tp", "4"))
    output = (tmp_path / "run.log").read_text()
    assert job["JobState"] == "FAILED"
    assert "--tp 4 does not divide the 2 processes" in output
    assert "starting step" not in output and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_compare_arrays_run_every_encoding_its_fine_tunes_then_the_report(cluster, data,
                                                                         tmp_path):
    out = tmp_path / "cmp"
    env = {**cluster.env, **job_environment(), "TUPE_DS_ROOT": ROOT,
           "SUBMIT_ARGS": f"--nodes=1 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 "
                          f"--time=30 --mem=1G --chdir={ROOT} --output={tmp_path}/run-%A_%a.log",
           "FINETUNE_ARGS": f"--nodes=1 --ntasks-per-node=1 --gpus-per-node=0 "
                            f"--cpus-per-task=1 --time=30 --mem=1G --chdir={ROOT} "
                            f"--output={tmp_path}/finetune-%A_%a.log",
           "REPORT_ARGS": f"--cpus-per-task=1 --mem=1G --time=10 --chdir={ROOT}"}
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "submit_compare.sh"), str(out),
                             "--data", data, "--encodings", "bert-a,tupe-r", "--steps", "6",
                             "--nproc", "1", "--eval-interval", "3", *TINY, "--finetune",
                             write_glue(tmp_path / "glue"), "--finetune-lr", "1e-3",
                             "--finetune-seeds", "1,2", "--finetune-epochs", "1"],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 runs planned" in result.stdout and "4 fine-tunes planned" in result.stdout
    runs, finetunes = (result.stdout.split(f"{kind}: job ")[1].split()[0]
                       for kind in ("runs", "fine-tunes"))
    report_job = result.stdout.split("report: job ")[1].split()[0]
    job = cluster.wait_until_done(report_job, timeout=500)
    tasks = "".join(p.read_text() for p in sorted(tmp_path.glob("run-*.log")))
    tuned = "".join(p.read_text() for p in sorted(tmp_path.glob("finetune-*.log")))
    assert job["JobState"] == "COMPLETED", tasks[-3000:] + tuned[-3000:] + cluster.logs()
    made = json.loads((out / "report.json").read_text())
    assert [(r["name"], r["state"]) for r in made["runs"]] == [("bert-a-seed1", "complete"),
                                                              ("tupe-r-seed1", "complete")]
    assert "1 tasks on" in tasks and "from srun (tp 1, pp 1, dp 1)" in tasks
    assert list(made["positional"]) == ["tupe-r"] and (out / "report.md").exists()
    ended = max(cluster.job(f"{runs}_{index}")["EndTime"] for index in range(2))
    assert ended <= min(cluster.job(f"{finetunes}_{index}")["StartTime"] for index in range(4))
    assert all(f"fine-tune {index}," in tuned for index in range(4))
    status = json.loads((out / "status.json").read_text())
    assert {name: (entry["exit"], os.path.dirname(entry["log"])) for name, entry in status.items()
            } == {f"{run}/{task}": (0, str(tmp_path)) for run in ("bert-a-seed1", "tupe-r-seed1")
                  for task in ("sst2", "stsb")}
    finetune = made["finetune"]
    assert set(finetune["states"].values()) == {"complete"}
    for run in ("bert-a-seed1", "tupe-r-seed1"):
        for task in ("sst2", "stsb"):
            written = json.loads((out / "finetune" / run / f"{task}.json").read_text())
            score = 100 * written["best_median"]["dev"][written["metric"]]
            assert finetune["table"]["scores"][run.split("-seed")[0]][task]["mean"] == score


@pytest.mark.slow
def test_two_phase_chain_starts_phase_2_from_phase_1_once_it_succeeded(cluster, data, tmp_path):
    """slurm/submit_two_phase.sh: phase 1 (seq 32 here), then, after it, phase 2 (seq 64) from
    its last checkpoint through --init-from (afterok)."""
    env = {**cluster.env, **job_environment(), "TUPE_DS_ROOT": ROOT, "PHASE1_STEPS": "4",
           "PHASE2_STEPS": "2", "PHASE1_SEQ_LEN": "32", "PHASE2_SEQ_LEN": "64",
           "SUBMIT_ARGS": " ".join(ONE_TASK_ON_THIS_NODE) + f" --chdir={ROOT} "
                          f"--output={tmp_path}/%x.log"}
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "submit_two_phase.sh"), data,
                             str(tmp_path / "bert"), *TINY, "--eval-interval", "100"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    phase1, phase2 = (result.stdout.split(f"phase {n}: job ")[1].split()[0] for n in (1, 2))
    job = cluster.wait_until_done(phase2, timeout=300)
    first, second = ((tmp_path / f"tupe-phase{n}.log").read_text() for n in (1, 2))
    assert job["JobState"] == "COMPLETED", first[-2000:] + second[-2000:] + cluster.logs()
    assert "samples of 32 tokens" in first and "samples of 64 tokens" in second
    assert f"initialised from {tmp_path}/bert/phase1/checkpoints/step4: its weights" in second
    assert cluster.job(phase1)["EndTime"] <= job["StartTime"]


@pytest.fixture(scope="module")
def prep_arrays(cluster, tmp_path_factory):
    """submit_prep.sh under --export=NONE (the jobs get every setting as an argument), sources a
    and b, 2 shards each, b's near-copies of 2 of a's documents; its output once both merges
    completed."""
    root = tmp_path_factory.mktemp("prep")
    rng = random.Random(5)
    first = [unique_document(rng, words=200) for _ in range(12)]
    second = [unique_document(rng, words=200) for _ in range(8)] + [near_copy(first[1]),
                                                                     near_copy(first[8])]
    files = {name: [write_txt(root / f"{name}{i}.txt", texts[i * 6:(i + 1) * 6])
                    for i in range(2)] for name, texts in (("a", first), ("b", second))}
    prep(files["a"] + files["b"], root / "tok", dedup="exact")
    tokenizer = str(root / "tok" / "tokenizer.json")
    prep(files["a"], root / "single", valid_fraction=0.01, tokenizer=tokenizer)
    env = {**cluster.env, **environment(), "PYTHON": sys.executable,
           "SUBMIT_ARGS": f"--export=NONE --cpus-per-task=1 --mem=1G --time=10 --chdir={root}"}
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "submit_prep.sh"), "2",
                             str(root / "out"), tokenizer,
                             *(f"{name}={','.join(paths)}" for name, paths in files.items())],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for merge in re.findall(r"merge: job (\d+)", result.stdout):
        job = cluster.wait(merge, lambda job: job["JobState"] not in (
            "PENDING", "CONFIGURING", "RUNNING", "COMPLETING") or job["Reason"] == (
            "DependencyNeverSatisfied"))  # a shard failed
        assert job["JobState"] == "COMPLETED", job_outputs(root) + cluster.logs()
    return root, result.stdout


def job_outputs(folder):
    return "".join(f"== {path}\n{path.read_text()[-2000:]}" for path in folder.glob("*.out"))


@pytest.mark.slow
def test_prep_arrays_of_two_sources_equal_one_run_and_the_second_loses_the_firsts_texts(
        prep_arrays):
    """a's merge equals one tupe-prep run; b's merge, after a's and --dedup-against it (an
    argument of the job, not its environment), removes b's near-copies of 2 of a's documents."""
    root, _ = prep_arrays
    merged = IndexedDataset(str(root / "out" / "a" / "merged" / "train"))
    one = IndexedDataset(str(root / "single" / "train"))
    assert (merged.sequence_lengths == one.sequence_lengths).all()
    assert all((merged[i] == one[i]).all() for i in range(len(one)))
    with open(root / "out" / "b" / "merged" / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["dedup_against"] == [str(root / "out" / "a" / "merged")]
    assert manifest["cross_corpus_near_duplicates_removed"] == 2
    assert manifest["documents_out"] == 8


def file_states(folder):
    """{path: (inode, mtime_ns, sha256)} of every file under `folder` (but the runs' lock)."""
    return {str(path.relative_to(folder)): (path.stat().st_ino, path.stat().st_mtime_ns,
                                            hashlib.sha256(path.read_bytes()).hexdigest())
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != LOCK}


@pytest.mark.slow
def test_the_printed_command_re_runs_one_shard_of_the_array_and_nothing_else(cluster,
                                                                              prep_arrays):
    """`sbatch --array=1 ...` as submit_prep.sh prints it (--export=NONE too) writes shard 1 of
    2 again, the same as the first time: shard 0, the merge and source b are untouched."""
    root, printed = prep_arrays
    before = file_states(root / "out")
    manifest = root / "out" / "a" / "shard1" / "manifest.json"
    first = json.loads(manifest.read_text())
    command = re.search(r"re-run shard K alone: (.*)", printed).group(1)  # source a's
    assert "--array=K " in command
    result = subprocess.run(["bash", "-c", command.replace("--array=K ", "--array=1 ")],
                            env=cluster.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job = cluster.wait_until_done(re.search(r"Submitted batch job (\d+)", result.stdout).group(1))
    assert job["JobState"] == "COMPLETED", job_outputs(root) + cluster.logs()
    after = file_states(root / "out")
    assert after.keys() == before.keys()
    rewritten = {path for path in after if after[path][:2] != before[path][:2]}
    assert rewritten == {path for path in after if path.startswith("a/shard1/")}, rewritten
    changed = {path for path in after if after[path][2] != before[path][2]}
    assert changed <= {"a/shard1/manifest.json"}, changed
    again = json.loads(manifest.read_text())
    assert again["config"]["shard"] == [1, 2] and again["inputs"] == [str(root / "a1.txt")]
    assert {**again, "seconds": None} == {**first, "seconds": None}


@pytest.mark.slow
def test_mpirun_trains_like_the_deepspeed_launcher(cluster, data, tmp_path):
    """OpenMPI's mpirun (installed with the cluster), ranks read through mpi4py."""
    pytest.importorskip("mpi4py", reason="pip install tupe_ds[mpi]")
    flags = [*TINY, "--data", data, "--steps", "4", "--eval-interval", "4", "--dropout", "0"]
    env = {**environment(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "MASTER_PORT": free_port()}
    result = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-m",
                             "tupe_ds.pretrain", *flags, "--out", str(tmp_path / "mpi")],
                            env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 processes from mpirun (tp 1, pp 1, dp 2)" in result.stdout
    deepspeed = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"),
                                "--num_gpus", "2", "--master_port", free_port(), "--module",
                                "tupe_ds.pretrain", *flags, "--out", str(tmp_path / "ds")],
                               env=environment(), capture_output=True, text=True, timeout=400)
    assert deepspeed.returncode == 0, deepspeed.stderr[-3000:]
    mpi, ds = log(tmp_path / "mpi"), log(tmp_path / "ds")
    for step in range(1, 5):
        assert mpi[step]["train/loss"] == pytest.approx(ds[step]["train/loss"], rel=1e-5), step


# How each launcher's variables become RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

def test_launcher_variables_are_kept():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
           "MASTER_PORT": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "9"}
    assert launch.discover(env) == "a launcher (RANK and WORLD_SIZE set)"
    assert env["RANK"] == "3"
    assert launch.discover({**env, "TORCHELASTIC_RUN_ID": "tupe"}) == "torchrun"
    assert launch.discover({**env, "CROSS_RANK": "0"}) == "deepspeed"


def test_srun_tasks_take_their_rank_from_slurm(monkeypatch, tmp_path):
    """Without scontrol on PATH (as in many containers); the port below Linux's ephemeral range."""
    monkeypatch.setenv("PATH", str(tmp_path))
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "123456"}
    assert launch.discover(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"],
            env["MASTER_PORT"]) == ("13", "16", "5", "gpu03", str(20000 + 123456 % 12768))
    assert {launch.srun_port(job) for job in range(100000)} == set(range(20000, 32768))
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "1"}  # no step
    assert launch.discover(batch_script) == "single process" and "RANK" not in batch_script


@pytest.mark.parametrize("nodelist, first", [
    ("n1", "n1"), ("n1,n2", "n1"), ("gpu[03-05,07]", "gpu03"), ("gpu[07,03-05]", "gpu07"),
    ("gpu[003-009],cpu1", "gpu003"), ("rack[2-3]-n[01-04],x9", "rack2-n01"),
    ("a-b[10-11].c", "a-b10.c")])
def test_the_first_host_of_a_node_list_is_read_without_scontrol(nodelist, first):
    assert launch.first_host(nodelist) == first


def test_mpirun_ranks_take_the_master_address_given(monkeypatch):
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "10.1.2.3"}
    assert launch.discover(env) == "mpirun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"],
            env["MASTER_PORT"]) == ("2", "4", "0", "10.1.2.3", "29500")


def test_interface_address_of_the_loopback_and_a_clear_error():
    assert launch.interface_address({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    with pytest.raises(RuntimeError, match="'nosuch0' .* has no IPv4 address"):
        launch.interface_address({"NCCL_SOCKET_IFNAME": "nosuch0"})


@pytest.mark.parametrize("job, given, expected", [("8", None, "8"), ("8", "4", "4"),
                                                    (None, None, "unset")])
def test_the_step_gets_the_jobs_cpus_per_task_and_a_node_local_extension_folder(
        tmp_path, job, given, expected):
    """srun_requeue hands the job's --cpus-per-task to its step (srun no longer inherits it since
    Slurm 22.05), and, unless set, a TORCH_EXTENSIONS_DIR under the node's TMPDIR; the user's
    SRUN_CPUS_PER_TASK and TORCH_EXTENSIONS_DIR win. A stand-in srun reports them."""
    (tmp_path / "srun").write_text('#!/bin/sh\necho "${SRUN_CPUS_PER_TASK:-unset} '
                                   '$TORCH_EXTENSIONS_DIR $*"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "1",
           "TMPDIR": str(tmp_path / "local")}
    env.update({"SLURM_CPUS_PER_TASK": job} if job else {})
    env.update({"SRUN_CPUS_PER_TASK": given, "TORCH_EXTENSIONS_DIR": "/shared/ext"}
               if given else {})
    script = f'source {ROOT}/slurm/srun_requeue.sh; srun_requeue python -m tupe_ds.pretrain'
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    extensions = ("/shared/ext" if given
                  else f"{tmp_path}/local/tupe_ds-torch-extensions-{os.getuid()}")
    assert result.stdout.split() == [expected, extensions, "--kill-on-bad-exit=1", "python",
                                     "-m", "tupe_ds.pretrain"]



@pytest.mark.parametrize("step_exit, requeued", [(0, True), (3, False)])
def test_a_warned_step_is_requeued_only_when_it_ended_with_0(tmp_path, step_exit, requeued):
    """SIGUSR1 to the batch shell: a step that saved and stopped (0) is requeued; one that ended
    with 3 (tupe-pretrain warned before its first step: the time limit leaves no time to train,
    every attempt would stop the same way) is not, saying so. A stand-in srun, whose warning
    comes after half a second and which ends with STEP_EXIT once passed it, and scontrol."""
    (tmp_path / "srun").write_text('#!/bin/bash\ntrap "exit $STEP_EXIT" USR1\nsleep 0.5\n'
                                   'kill -USR1 $PPID\nwhile :; do sleep 0.1; done\n')
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/scontrol.log\n')
    for stand_in in ("srun", "scontrol"):
        (tmp_path / stand_in).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "MASTER_PORT": "29500", "STEP_EXIT": str(step_exit)}
    script = f"source {ROOT}/slurm/srun_requeue.sh; srun_requeue python -m tupe_ds.pretrain"
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == step_exit, result.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 7\n" if requeued else "")
    said = "the job is not requeued: its step ended with exit status 3"
    assert (said in result.stderr) is not requeued, result.stderr

def test_pretrain_script_explains_its_usage():
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "pretrain.sbatch")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "usage: sbatch slurm/pretrain.sbatch" in result.stderr


@pytest.mark.parametrize("data, expected", [
    ("0.7 /p/wiki 0.3 /p/books", ["0.7", "/p/wiki", "0.3", "/p/books"]),
    ("/p/my data", ["/p/my data"])])
def test_pretrain_script_passes_a_blend_or_a_folder_as_data(tmp_path, data, expected):
    """DATA, one argument of sbatch: a blend's weights and folders become --data's values; a
    folder (spaces and all) stays one. A stand-in python and srun print what they are given."""
    env = stand_in_python_and_srun(tmp_path)
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "pretrain.sbatch"), "bert-large",
                             data, "/runs/x", "--tp", "2"], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    commands = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(commands) == 2  # the check, then the step
    for argv in commands:
        start = argv.index("--data") + 1
        assert argv[start:start + len(expected) + 1] == [*expected, "--out"], argv


def test_shard_script_explains_its_usage_and_takes_its_shard_from_the_task_id_and_count():
    def shard_script(*arguments, task=None):
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": task, "SLURM_CPUS_PER_TASK": "3"} if (
            task) else None
        return subprocess.run(["bash", os.path.join(ROOT, "slurm", "prep_shard.sbatch"),
                               *arguments], env=env, capture_output=True, text=True)

    result = shard_script()
    assert result.returncode == 2 and "usage: sbatch --array" in result.stderr
    result = shard_script("out", "tok.json", "input", task="7")
    assert result.returncode == 2 and "--count N, the number of shards, is required" in (
        result.stderr)
    result = shard_script("--count", "4", "out", "tok.json", "input", task="7")
    assert result.returncode == 2 and "array task 7 is no shard of --count 4" in result.stderr
    result = shard_script("--count", "8", "--python", "echo", "out", "tok.json", "in0", "in1",
                          "--", "--lowercase", task="7")
    assert result.returncode == 0 and result.stdout.split() == [
        "-m", "data_prep", "--input", "in0", "in1", "--out", "out/shard7", "--tokenizer",
        "tok.json", "--shard", "7/8", "--workers", "3", "--lowercase"]  # its progress logged


def test_doctor_in_the_test_clusters_allocation_says_what_the_ranks_will_use(cluster, data,
                                                                            tmp_path):
    """tupe-doctor --slurm inside a job: the node, tasks, CPUs, rendezvous, backend and folders."""
    out = tmp_path / "doctor.log"
    job = cluster.wait_until_done(cluster.sbatch(
        *SBATCH_ON_THIS_NODE, f"--output={out}", f"--chdir={ROOT}", "--wrap",
        f"{sys.executable} -m tupe_ds.machine.doctor --slurm --data {data} "
        f"--out {tmp_path / 'run'}",
        env=job_environment()))
    said = out.read_text()
    assert job["JobState"] == "COMPLETED", said[-3000:]
    job_id = int(job["JobId"])
    assert "nodes: 1 (" in said and "tasks: 2 (2 per node)" in said
    assert "CPUs per task: 1 (the step gets 1" in said
    assert f":{launch.srun_port(job_id)}; backend gloo" in said
    assert f"torch extensions: {job_environment()['TORCH_EXTENSIONS_DIR']}" in said
    assert f"--out {tmp_path / 'run'}: " in said and f"--data {data}: " in said


def test_ports_are_checked_free_below_the_ephemeral_range_and_a_taken_one_is_passed_over(
        tmp_path):
    with socket.socket() as held:
        held.bind(("", launchers.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert launchers.FIRST_PORT <= taken < launchers.ephemeral_ports()[0]
        with logged_lines() as said:
            chosen = launchers.free_port(taken)
            assert chosen != taken and said == [
                f"tupe_ds: port {taken} is in use on this machine: port {chosen} instead"]
            assert launchers.free_port(chosen) == chosen and len(said) == 1
    # a port an ended run's rendezvous left in TIME_WAIT: free to torch's store, so free to us
    with socket.socket() as server, socket.socket() as client:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore
        server.bind(("127.0.0.1", launchers.free_port()))
        server.listen()
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
        client.recv(1)
        waiting = server.getsockname()[1]
    with pytest.raises(OSError), socket.socket() as plain:
        plain.bind(("", waiting))  # what the check did before
    assert launchers.port_is_free(waiting)
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    assert launchers.ephemeral_ports(str(ranges)) == (40000, 50000)
    assert launchers.ephemeral_ports(str(tmp_path / "none")) == (32768, 60999)


def test_the_slurm_scripts_rendezvous_port_is_the_jobs_or_the_next_free_one():
    """What slurm/srun_requeue.sh runs on the batch host before srun (the step's tasks then read
    MASTER_PORT): the job id's port, or the next free one when another process holds it."""
    with socket.socket() as held:
        held.bind(("", launchers.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        job = str(taken - launch.SRUN_PORTS[0])  # a job id whose port is the one held
        result = subprocess.run([sys.executable, "-m", "tupe_ds.distributed.launchers",
                                 "srun-port"], env={**environment(), "SLURM_JOB_ID": job},
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    chosen = int(result.stdout)
    assert chosen != taken and result.stderr == (
        f"tupe_ds: port {taken} is in use on this machine: port {chosen} instead\n")


@pytest.mark.parametrize("sources, message", [
    (["wiki=a.txt", "wiki=b.txt"], "the name 'wiki' is given twice"),
    (["wiki=a.txt", "b.txt"], "b.txt: with several sources, name each"),
    (["=a.txt"], "the source's name '' must be"),
    (["x/../..=b.txt"], "INPUT: x/../..=b.txt does not exist"),
    (["wiki=a.txt", "books=missing.txt"], "INPUT: missing.txt of source books does not exist"),
    (["wiki=a.txt", "books="], "books=: no INPUT after 'books='"),
    (["lang=en/a.txt"], "write it ./lang=..."),
])
def test_submit_prep_checks_every_source_before_it_queues_anything(tmp_path, sources, message):
    """A bad source later on the line used to be found after the earlier ones were queued."""
    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path / 'queued'}\necho 1\n")
    sbatch.chmod(0o755)
    for name in ("a.txt", "b.txt", "tok.json"):
        (tmp_path / name).write_text("text\n")
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "slurm", "submit_prep.sh"), "2", "out", "tok.json", *sources],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
             "PYTHON": sys.executable})
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "queued").exists()
