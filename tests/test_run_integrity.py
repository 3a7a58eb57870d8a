"""A run never loses its work (tupe_ds/train/checkpoint/, tupe_ds/train/nonfinite.py): the fault
matrix of docs/reliability.md's "What a run survives", with real processes (2 CPU ranks under
torchrun; one process as typed where a test checks nothing of ranks; ZeRO-2, fp32, dropout
off) and faults injected by tests/support/fault_worker.py. Each test checks what is kept, what
is resumed and what is said, and, where the fault allows, that the run ends with the losses and
weights of an uninterrupted one. A process's start (torch, Megatron, DeepSpeed imported) costs
more than its training: a test that damages or inspects a run starts from a copy of the
module's `reference`."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import CPU_CONFIG, ROOT, environment, free_port, log, losses
from tupe_ds.tools.errors import Refused
from tupe_ds.train.checkpoint import manifest, safe_load, same_run

FAULT_WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")
FLAGS = ["--steps", "12", "--save-interval", "2", "--eval-interval", "12", "--dropout", "0",
         "--lr", "2e-3", "--warmup-steps", "2"]


def command(data, out, *flags, processes=2, monitor_interval=0.1):
    """Several processes under torchrun; one without a launcher (whose start costs 2 CPU
    seconds), as typed (its exit code its own, not torchrun's 1)."""
    launcher = [] if processes == 1 else [
        "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--monitor-interval",
        str(monitor_interval), "--master_port", free_port()]
    return [sys.executable, *launcher, FAULT_WORKER, "pretrain", "--data", data, "--model",
            "tiny", "--ds-config", CPU_CONFIG, "--out", str(out), "--seq-len", "64",
            "--log-interval", "1", "--eval-samples", "32", *flags]


def run(data, out, *flags, fault="", expect=0, env=None, processes=2):
    """The run's stdout and stderr together; `expect`: its exit code (None: killed). One process
    (`processes=1`) where a test checks nothing of several ranks: a rank's start (importing torch,
    Megatron and DeepSpeed) is most of what a test's run costs."""
    # torchrun ends the other ranks at its first look after one exits non-zero: a rank that
    # stopped as well, a moment later on a loaded machine, would be ended before it says its exit
    # code (before its first step SIGTERM ends a rank, by design: stop_signal.py). Looking every
    # 5 s (its default 0.1 s) lets each rank end on its own, for at most 5 s of waiting.
    interval = 5 if expect not in (0, None) else 0.1
    result = subprocess.run(command(data, out, *flags, processes=processes,
                                    monitor_interval=interval), env={**environment(),
                            "TUPE_DS_FAULT": fault, **(env or {})}, capture_output=True,
                            text=True, timeout=300, start_new_session=True)
    output = result.stdout + result.stderr
    if expect is None:
        assert result.returncode == -9, output[-4000:]  # the fault's SIGKILL
    else:
        assert result.returncode == expect, output[-4000:]
    return output


def steps_in(out):
    return sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step"))


def set_aside(out):
    """{stepN: folder} of everything set aside."""
    root = out / "checkpoints" / "set-aside"
    return {name: root / when / name for when in os.listdir(root)
            for name in os.listdir(root / when)} if root.is_dir() else {}


def weights(step_dir):
    return safe_load.load(os.path.join(step_dir, "mp_rank_00_model_states.pt"))["module"]


def assert_same_weights(step_dir, reference_dir):
    mine, theirs = weights(step_dir), weights(reference_dir)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        if torch.is_tensor(tensor):
            torch.testing.assert_close(mine[name], tensor, rtol=0, atol=1e-6, msg=name)


def assert_same_losses(out, reference, steps=range(1, 13)):
    mine, theirs = losses(out), losses(reference)
    for step in steps:
        assert mine[step] == pytest.approx(theirs[step], rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run: 12 steps, checkpoints step6..step12 kept."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run(data, out, *FLAGS, "--keep-checkpoints", "4")
    assert steps_in(out) == ["step10", "step12", "step6", "step8"]
    return out


@pytest.mark.slow
def test_killed_at_every_phase_of_a_save_the_run_loses_nothing(data, reference, tmp_path):
    """SIGKILL to every rank and the launcher: after rank 0's model file, after rank 1's
    optimizer shard, after the manifest (before `latest` moved), during retention's deletion,
    after `latest`. The same command each time; the run ends as the uninterrupted one."""
    out, flags = tmp_path / "run", [*FLAGS, "--keep-checkpoints", "2"]
    checkpoints = out / "checkpoints"
    run(data, out, *flags, fault="kill-after-file:mp_rank_00_model_states.pt:2", expect=None)
    assert steps_in(out) == ["step2"] and not manifest.exists(checkpoints / "step2")

    said = run(data, out, *flags, fault="kill-after-file:zero_pp_rank_1_*:4", expect=None)
    assert "starting step 0 of 12" in said  # nothing complete: a fresh start, nothing deleted
    assert "step2 (an earlier save of this step, in the way) moved to" in said
    assert set(set_aside(out)) == {"step2"}
    assert (checkpoints / "latest").read_text() == "step2"
    assert not manifest.exists(checkpoints / "step4")

    said = run(data, out, *flags, fault="kill-after-manifest:6", expect=None)
    assert "resumed at step 2 of 12" in said and "step4 (newer than step2" in said
    assert manifest.exists(checkpoints / "step6")
    assert (checkpoints / "latest").read_text() == "step4"  # the manifest decides, not latest

    said = run(data, out, *flags, fault="kill-during-deletion:8", expect=None)
    assert "resumed at step 6 of 12" in said
    assert steps_in(out) == ["step4", "step6", "step8"]  # step2 half removed, out of sight
    assert [n for n in os.listdir(checkpoints) if n.startswith(".deleting-")] == [
        ".deleting-step2"]

    said = run(data, out, *flags, fault="kill-after-latest:10", expect=None)
    assert "resumed at step 8 of 12" in said
    assert (checkpoints / "latest").read_text() == "step10"
    assert steps_in(out) == ["step10", "step4", "step6", "step8"]  # retention never ran

    said = run(data, out, *flags)
    assert "resumed at step 10 of 12" in said
    assert steps_in(out) == ["step10", "step12"]
    assert not [n for n in os.listdir(checkpoints) if n.startswith(".deleting-")]
    assert set(set_aside(out)) == {"step2", "step4"}  # the cut-short saves, kept
    assert_same_losses(out, reference)
    assert_same_weights(checkpoints / "step12", reference / "checkpoints" / "step12")


def read_errors(files, seconds=None):
    """The environment in which every process of a run fails to open `files` (a pattern) with
    EIO, for `seconds` from its first try (tests/support/read_errors), and retries a read for
    3 s."""
    return {"PYTHONPATH": f"{os.path.join(ROOT, 'tests', 'support', 'read_errors')}:{ROOT}",
            "TUPE_DS_EIO_FILES": files, "TUPE_DS_READ_RETRY_SECONDS": "3",
            **({"TUPE_DS_EIO_SECONDS": str(seconds)} if seconds else {})}


@pytest.mark.slow
def test_a_read_error_stops_the_run_with_nothing_moved_and_a_short_one_is_waited_out(
        data, reference, tmp_path):
    """EIO on step12's pickles (a Lustre or NFS client after a server hiccup; its manifest
    reads): verification retries each file, then every rank stops (exit code 3) naming it, with
    nothing set aside; the same command, the errors lasting 1 s, resumes step12."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    said = run(data, out, *FLAGS, "--steps", "14", "--allow-training-changes", expect=1,
               env=read_errors(f"{checkpoints}/step12/*.pt"))
    assert f"tupe-pretrain: reading {checkpoints}/step12/" in said and \
        "failed ([Errno 5] Input/output error); trying again for up to 3 s" in said
    assert f"tupe-pretrain: could not read {checkpoints}/step12/" in said and \
        "([Errno 5] Input/output error) for 3 s: nothing was moved or deleted; run the same " \
        "command once the filesystem answers" in said
    assert "exit worker: rank 0, exit code 3" in said and "exit worker: rank 1, exit code 3" in said
    assert "[rank0]: Traceback" not in said and "failed verification" not in said
    assert steps_in(out) == steps_in(reference) and set_aside(out) == {}
    said = run(data, out, *FLAGS, "--steps", "14", "--allow-training-changes",
               env=read_errors(f"{checkpoints}/step12/*.pt", seconds=1))
    assert "trying again for up to 3 s" in said and "resumed at step 12 of 14" in said
    assert set_aside(out) == {}


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.slow
def test_damaged_checkpoints_are_reported_and_the_run_falls_back(data, reference, tmp_path):
    """`latest` missing, step12 without rank 1's random state, one flipped byte in step10, a
    truncated optimizer shard in step8, and a stray checkpoint of another run: the run names each
    problem, resumes from step6, sets the damaged ones aside, and never touches the stray."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    (checkpoints / "latest").unlink()
    (checkpoints / "step12" / "rng_rank1.pt").unlink()
    flip_byte(checkpoints / "step10" / "mp_rank_00_model_states.pt", 5000)
    shard = checkpoints / "step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    stray = checkpoints / "step4"  # another run's checkpoint (its lineage), copied in
    shutil.copytree(checkpoints / "step6", stray)
    record = manifest.read(checkpoints / "step6")
    record.update(lineage="another run", step=4, tag="step4")
    manifest.write(stray, record)

    said = run(data, out, *FLAGS, "--keep-checkpoints", "2")
    assert f"{checkpoints}/step12/rng_rank1.pt: missing" in said
    assert f"{checkpoints}/step10/mp_rank_00_model_states.pt: its checksum differs" in said
    assert f"{shard}: 1000 bytes where the manifest says" in said
    assert "resuming from step6, the previous complete checkpoint" in said
    assert "resumed at step 6 of 12" in said
    assert set(set_aside(out)) == {"step8", "step10", "step12"}
    assert steps_in(out) == ["step10", "step12", "step4"]  # step6, step8 retired; stray kept
    assert manifest.read(stray)["lineage"] == "another run"
    assert_same_losses(out, reference, range(7, 13))
    assert_same_weights(checkpoints / "step12", reference / "checkpoints" / "step12")


def nan_config(tmp_path, precision):
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    path = tmp_path / f"{precision}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_steps_that_are_not_finite_are_not_applied_and_a_run_of_them_stops(data, tmp_path,
                                                                           precision):
    """NaN in rank 1's loss at step 3 and in one gradient element of rank 0 at step 5: both
    steps are skipped on every rank (the schedule counts them: schedule.follow_step) and
    counted; NaN loss at steps 7-9 stops the run at step 9 (--max-nonfinite-steps 3), naming
    the last good checkpoint; every checkpoint holds finite weights."""
    out = tmp_path / "run"
    said = run(data, out, "--steps", "12", "--save-interval", "2", "--eval-interval", "12",
               "--warmup-steps", "4", "--ds-config", nan_config(tmp_path, precision),
               fault="nan-loss:1:3,7,8,9;nan-grad:0:5", expect=1)
    entries = log(out)
    lr = {step: entries[step]["train/lr"] for step in entries if "train/lr" in entries[step]}
    assert lr[2] < lr[3] < lr[4] < lr[5] < lr[6], lr  # a step not applied counts as a step
    assert [entries[s]["train/nonfinite_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert "step 3: loss or gradient not finite, the update was not applied (1 in a row, 1 in " \
           "this run" in said
    assert "step 5: loss or gradient not finite" in said
    assert "stopping at step 9: 3 steps in a row had a loss or gradient that is not finite" in said
    assert "Last good checkpoint: step8" in said
    assert "exit worker: rank 0, exit code 3" in said and "exit worker: rank 1, exit code 3" in said
    assert entries[9]["train/nonfinite_steps"] == 5  # the stop's count reaches TensorBoard too
    assert steps_in(out) == ["step4", "step6", "step8"]
    for step in ("step6", "step8"):
        for name, tensor in weights(out / "checkpoints" / step).items():
            assert not torch.is_tensor(tensor) or torch.isfinite(tensor).all(), (step, name)


@pytest.mark.slow
def test_a_weight_that_is_not_finite_is_never_saved(data, tmp_path):
    out = tmp_path / "run"
    said = run(data, out, "--steps", "6", "--save-interval", "2", "--eval-interval", "6",
               fault="nan-weight:1:4", expect=1)
    assert "the weights at step 4 are not all finite: checkpoint step4 was not written; the " \
           "last good checkpoint is step2" in said
    assert steps_in(out) == ["step2"]


@pytest.mark.slow
def test_init_from_starts_a_new_run_at_a_longer_seq_len_from_a_checkpoint(data, tmp_path):
    """BERT's two phases in small: phase 1 at seq 32, phase 2 at seq 64 from its last
    checkpoint. At step 1 the learning rate is 0 (the new warm-up), so phase 2's step-1
    checkpoint holds exactly phase 1's weights; the same command again resumes phase 2's own
    checkpoint; phase 1's folder is untouched. (Phase 2 from the weights alone runs in one
    process, as it may on another layout: nothing it checks concerns ranks; --init-optimizer,
    which loads each rank's ZeRO partition of the moments, on phase 1's 2.)"""
    phase1 = tmp_path / "phase1"
    run(data, phase1, "--seq-len", "32", "--steps", "8", "--lr", "2e-3", "--warmup-steps", "2",
        "--dropout", "0")
    before = manifest.digest(phase1 / "checkpoints" / "step8")
    out = tmp_path / "phase2"
    flags = ["--save-interval", "1", "--eval-interval", "100", "--init-from", str(phase1),
             "--warmup-steps", "2", "--dropout", "0"]
    said = run(data, out, *flags, "--steps", "1", processes=1)
    assert f"initialised from {phase1}/checkpoints/step8: its weights;" in said
    assert "starting step 0 of 1" in said and "samples of 64 tokens" in said
    assert log(out)[1]["train/lr"] == 0
    assert losses(out)[1] < losses(phase1)[1] - 0.05  # trained weights, not new ones
    assert_same_weights(out / "checkpoints" / "step1", phase1 / "checkpoints" / "step8")
    said = run(data, out, *flags, "--steps", "2", processes=1)
    assert "resumed at step 1 of 2" in said and "initialised" not in said
    said = run(data, tmp_path / "with-moments", *flags, "--steps", "1", "--init-optimizer")
    assert f"initialised from {phase1}/checkpoints/step8: its weights and optimizer state" in said
    assert manifest.digest(phase1 / "checkpoints" / "step8") == before
    assert steps_in(phase1) == ["step8"]


def refusal(argv, monkeypatch, world=2):
    from tupe_ds.train.config import load

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(Refused) as error:
        load(argv)
    return str(error.value)


def flags_of(data, out, *extra):
    return ["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out),
            "--seq-len", "64", *FLAGS, *extra]


def test_another_run_is_refused_before_any_process_starts_naming_each_difference(
        data, reference, tmp_path, monkeypatch):
    """Other data, seq-len, global batch, loss normalisation, mask rate or dropout; --resume
    never; a ZeRO-2 checkpoint on ZeRO stage 0 elsewhere; a newer stray checkpoint of another
    run; --init-from a model of another shape. Nothing in the folder changes."""
    before = {n: manifest.digest(reference / "checkpoints" / n) for n in steps_in(reference)}
    other_data = tmp_path / "other-data"  # the same files, train and valid swapped
    shutil.copytree(data, other_data)
    for suffix in (".bin", ".idx"):
        os.replace(other_data / f"train{suffix}", other_data / f"tmp{suffix}")
        os.replace(other_data / f"valid{suffix}", other_data / f"train{suffix}")
        os.replace(other_data / f"tmp{suffix}", other_data / f"valid{suffix}")
    step12 = reference / "checkpoints" / "step12"
    said = refusal(flags_of(str(other_data), reference), monkeypatch)
    assert f"{step12} is another run than this command's: the data (--data): other content " \
           "than the checkpoint's (data.train)" in said
    assert f"--init-from {step12}" in said
    said = refusal(flags_of(data, reference, "--seq-len", "32", "--global-batch", "32",
                            "--dropout", "0.1", "--loss-normalization", "micro-batch",
                            "--mask-rate", "0.3"),
                   monkeypatch)
    for difference in ("global_batch: 16 in the checkpoint, 32 now",
                       "seq_len: 64 in the checkpoint, 32 now (--seq-len)",
                       "loss_normalization: 'per-token' in the checkpoint, 'micro-batch' now "
                       "(--loss-normalization)",
                       "masking.probability: 0.15 in the checkpoint, 0.3 now (--mask-rate)",
                       "models[0].hidden_dropout: 0.0 in the checkpoint, 0.1 now"):
        assert difference in said
    said = refusal(flags_of(data, reference, "--resume", "never"), monkeypatch)
    assert "--resume never, and it holds checkpoints of a run (step6, step8, step10, step12)" \
        in said and "nothing is overwritten" in said
    bf16 = nan_config(tmp_path, "bf16")
    said = refusal(flags_of(data, reference, "--ds-config", bf16, "--zero-stage", "0"),
                   monkeypatch, world=1)
    assert "its optimizer state is partitioned by ZeRO, which ZeRO stage 0 does not load" in said
    said = refusal(flags_of(data, reference, "--zero-stage", "0"), monkeypatch)
    assert "ZeRO stage 0 in fp32: DeepSpeed hands the gradients to torch's optimizer" in said
    said = refusal(flags_of(data, tmp_path / "new", "--init-from", str(reference),
                            "--pos-encoding", "bert-a"), monkeypatch)
    assert "its model is not this run's: models[0].pos_encoding: 'tupe-r' in the checkpoint, " \
           "'bert-a' now" in said
    assert before == {n: manifest.digest(reference / "checkpoints" / n)
                      for n in steps_in(reference)}

    stray = tmp_path / "stray"  # a newer checkpoint of another run, copied in
    shutil.copytree(reference, stray)
    shutil.copytree(reference / "checkpoints" / "step12", stray / "checkpoints" / "step14")
    record = manifest.read(stray / "checkpoints" / "step12")
    record.update(step=14, tag="step14")
    record["identity"]["seed"] = 7
    manifest.write(stray / "checkpoints" / "step14", record)
    said = refusal(flags_of(data, stray), monkeypatch)
    assert "step14 is another run than this command's: seed: 7 in the checkpoint, 1234 now" in said
    assert steps_in(stray) == ["step10", "step12", "step14", "step6", "step8"]


def test_a_checkpoint_file_that_would_run_code_is_refused_before_deepspeed_reads_it(
        reference, tmp_path):
    """A model file replaced by a pickle that runs a command, with a manifest rewritten to match
    (as its sender would): tupe-export names the file, and the command never runs."""
    from tupe_ds.export.write import main as export_main

    run_dir = tmp_path / "sent"
    shutil.copytree(reference, run_dir)
    step_dir = run_dir / "checkpoints" / "step12"
    witness = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {witness}",)

    path = step_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": Payload()}, path)
    record = manifest.read(step_dir)
    record["files"].update(manifest.describe(str(step_dir), [path.name]))
    manifest.write(step_dir, record)
    assert export_main([str(run_dir), "--out", str(tmp_path / "exported")]) == 2
    assert not witness.exists()
    assert safe_load.scan(str(path)).startswith(f"{path}: holds more than tensors")
    assert safe_load.scan(str(reference / "checkpoints" / "step12" / path.name)) is None


def start(data, out, *flags, fault="", logs=None):
    """A run in the background: (process, its output file, in `logs`: default out's folder)."""
    logs = logs or out.parent
    output = open(logs / f"{out.name}-{len(os.listdir(logs))}.log", "w+")
    process = subprocess.Popen(command(data, out, *flags), env={**environment(),
                               "TUPE_DS_FAULT": fault}, stdout=output,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return process, output


def wait_for(path, process, seconds=240):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert process.poll() is None and time.monotonic() < deadline, "the run never got there"
        time.sleep(0.2)


@pytest.mark.slow
def test_one_job_per_run_folder(data, reference, tmp_path, monkeypatch):
    """A second job (and --check-only) on a folder whose run trains is refused before any work,
    naming the holder; the first goes on and logs each step once. Killed, its lock is taken over
    by the next job, saying so; a run whose lock another job took stops before its next log line.
    (The first run is the one killed, in step 5, its lock left behind: the job that takes it over
    ends the run, exit 0 and its lock released, as the uninterrupted one; the refused job runs
    in one process, its refusal coming before any rank's work.)"""
    out, flags = tmp_path / "run", [*FLAGS, "--keep-checkpoints", "4"]
    hold = tmp_path / "hold"
    first, output = start(data, out, *flags, fault=f"hold:3:{hold};kill-mid-step:5")
    wait_for(f"{hold}.waiting", first)
    holder = json.loads((out / "run.lock").read_text())
    said = run(data, out, *flags, expect=2, processes=1)
    assert f"this run folder is in use by process {holder['pid']} on {holder['host']}" in said
    assert "Wait for that job to end, or give this one another --out" in said
    assert "starting step" not in said and "resumed at" not in said
    said = refusal(flags_of(data, out, "--check-only"), monkeypatch)
    assert "this run folder is in use by process" in said
    hold.touch()
    assert first.wait(240) == -9  # went on past the hold, to its kill in step 5
    output.seek(0)
    assert "fault fired: kill-mid-step:5" in output.read()
    dead = json.loads((out / "run.lock").read_text())["pid"]
    assert dead == holder["pid"]  # the lock the refused job named, left as the first held it
    said = run(data, out, *flags)
    assert f"took over {out}/run.lock from process {dead} on" in said
    assert "its process has ended" in said and "resumed at step 4 of 12" in said
    assert not (out / "run.lock").exists()
    entries = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in entries if "train/loss" in e) == list(range(1, 13))
    assert_same_losses(out, reference)
    assert_same_weights(out / "checkpoints" / "step12", reference / "checkpoints" / "step12")

    stolen = tmp_path / "stolen"
    said = run(data, stolen, *flags, fault="steal-lock:3", expect=1)
    assert "this run no longer holds its run folder" in said and "stopping without saving" in said
    assert "exitcode  : 3" in said  # rank 0 alone (torchrun's report): no collective per write
    assert steps_in(stolen) == ["step2"]  # nothing written after the lock was lost


def plant_payload(path, witness):
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {witness}",)

    torch.save({"optimizer_state_dict": Payload()}, path)


def list_in_manifest(step_dir, *names):
    record = manifest.read(step_dir)
    record["files"].update(manifest.describe(str(step_dir), list(names)))
    manifest.write(step_dir, record)


@pytest.mark.slow
def test_a_file_that_would_run_code_never_runs_listed_unlisted_or_renamed(data, reference,
                                                                          tmp_path):
    """Planted pickles that would create a file: in step12 in place of an optimizer shard with
    the manifest rewritten to match, in step10 beside it unlisted, in step8 listed under a name
    of its own. The resume names each and falls back to step6; --init-from refuses such a
    checkpoint; a conversion for another layout holding one is made anew; tupe-export refuses
    each; and torch.load with weights_only=False, as DeepSpeed calls it, is made safe in these
    commands' processes. The witness file never appears."""
    from tupe_ds.export.write import main as export_main

    out, witness = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    plant_payload(checkpoints / "step12" / shard, witness)
    list_in_manifest(checkpoints / "step12", shard)
    plant_payload(checkpoints / "step10" / f"bf16_{shard}", witness)
    renamed = "zero_pp_rank_7_mp_rank_00_optim_states.pt"
    plant_payload(checkpoints / "step8" / renamed, witness)
    list_in_manifest(checkpoints / "step8", renamed)
    for step_dir in ("step12", "step10", "step8"):
        assert export_main([str(checkpoints / step_dir), "--out", str(tmp_path / "x")]) == 2
    said = run(data, tmp_path / "new", *FLAGS, "--steps", "1", "--init-from",
               str(checkpoints / "step12"), expect=2, processes=1)  # nothing of ranks here
    assert f"--init-from {checkpoints}/step12 does not verify" in said
    assert f"{checkpoints}/step12/{shard}: holds more than tensors" in said
    assert f"such as the previous complete one: --init-from {checkpoints}/step10" in said
    assert not (tmp_path / "new" / "history.jsonl").exists()  # a refused start records none

    said = run(data, out, *FLAGS, "--keep-checkpoints", "4")
    assert f"{checkpoints}/step12/{shard}: holds more than tensors" in said
    assert f"{checkpoints}/step10/bf16_{shard}: not listed in its manifest" in said
    assert f"{checkpoints}/step8/{renamed}: holds more than tensors" in said
    assert "resumed at step 6 of 12" in said
    assert_same_weights(checkpoints / "step12", reference / "checkpoints" / "step12")

    converted = checkpoints / "universal" / "step12"
    for attempt in range(2):  # the second finds a payload in the conversion: converted anew
        result = subprocess.run(command(data, out, *FLAGS, processes=1), env=environment(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "converted for 1 process " in result.stdout and "reused" not in result.stdout
        plant_payload(next(converted.rglob("exp_avg.pt")), witness)
    assert not witness.exists()

    plant_payload(tmp_path / "payload.pt", witness)  # here, as in a command's process: its
    with safe_load.weights_only_loads():  # weights_only_everywhere(), the environment restored
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            torch.load(tmp_path / "payload.pt", weights_only=False)
    assert not witness.exists()


def rewrite_manifest(step_dir, source=None, **fields):
    """step_dir's manifest: `source`'s (default its own) with `fields` changed."""
    record = manifest.read(source or step_dir)
    record.update(fields)
    manifest.write(step_dir, record)


@pytest.mark.slow
def test_damage_means_fallback_never_a_refusal(data, reference, tmp_path):
    """A flipped character in step12's manifest (its vocabulary digest: read as such, another
    run's), step10's layout.json rewritten, the older step6's manifest unreadable, run.json,
    `latest` and the lock garbage: the run resumes step8, saying why each is passed over, and
    ends as the uninterrupted run; the old damaged checkpoint is kept."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    text = (checkpoints / "step12" / "manifest.json").read_text()
    vocabulary = manifest.read(checkpoints / "step12")["identity"]["vocabulary"]
    flipped = vocabulary[:5] + ("0" if vocabulary[5] != "0" else "1") + vocabulary[6:]
    (checkpoints / "step12" / "manifest.json").write_text(text.replace(vocabulary, flipped))
    (checkpoints / "step10" / "layout.json").write_text("{}")
    (checkpoints / "step6" / "manifest.json").write_bytes(b"\xff\xfe\x00")
    (out / "run.json").write_text("[")
    (checkpoints / "latest").write_bytes(os.urandom(8))
    (out / "run.lock").write_bytes(b"\x00 damaged")
    said = run(data, out, *FLAGS, "--keep-checkpoints", "4")
    assert f"checkpoint step12: {checkpoints}/step12/manifest.json: not a manifest tupe-pretrain " \
           "wrote (format 1): its checksum differs from its content" in said
    assert "not complete, not resumed" in said and "another run than" not in said
    assert f"{checkpoints}/step10/layout.json: 2 bytes where the manifest says" in said
    assert f"{out}/run.json: not readable as a run description" in said
    assert f"took over {out}/run.lock from an unknown holder: the lock file is damaged" in said
    assert "resumed at step 8 of 12" in said
    assert_same_losses(out, reference, range(9, 13))
    assert_same_weights(checkpoints / "step12", reference / "checkpoints" / "step12")
    assert (checkpoints / "step6").is_dir()  # neither retired nor a fallback
    assert {"step10", "step12"} <= set(set_aside(out))


@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_stop_before_loading(data, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    said = run(data, out, *FLAGS, "--steps", "14", "--allow-training-changes",
               fault="stale-view:1:step12", expect=1)
    assert "the ranks see different checkpoints" in said
    assert "rank 0 would resume step12, and rank 1 on" in said and "sees step12 not at all" in said
    assert "exit worker: rank 1, exit code 2" in said
    assert steps_in(out) == steps_in(reference)


def test_resume_refusals_name_what_to_change_and_accept_it(data, reference, tmp_path,
                                                           monkeypatch):
    """Before any process starts: ZeRO 2 <-> 3; a newer checkpoint of another run (lineage);
    changed optimizer or schedule settings unless --allow-training-changes; --resume-from outside
    --out. Each message's suggestion is then accepted."""
    from tupe_ds.train.config import load

    def accepted(argv, world=2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return load(argv)

    said = refusal(flags_of(data, reference, "--zero-stage", "3"), monkeypatch)
    assert "ZeRO stage 3 partitions the weights themselves" in said
    assert "resume with --zero-stage 2" in said
    said = refusal(flags_of(data, tmp_path / "new", "--init-from", str(reference),
                            "--zero-stage", "3"), monkeypatch)
    assert "under ZeRO stage 3 the weights are partitioned" in said
    stage3 = tmp_path / "stage3"
    shutil.copytree(reference, stage3)
    for step in ("step10", "step12"):
        rewrite_manifest(stage3 / "checkpoints" / step,
                         layout={**manifest.read(stage3 / "checkpoints" / step)["layout"],
                                 "zero_stage": 3})
    said = refusal(flags_of(data, stage3), monkeypatch)
    assert "resume with --zero-stage 3" in said
    assert accepted(flags_of(data, stage3, "--zero-stage", "3")).resume_plan.tag == "step12"

    stray = tmp_path / "stray"
    shutil.copytree(reference, stray)
    shutil.copytree(stray / "checkpoints" / "step12", stray / "checkpoints" / "step14")
    rewrite_manifest(stray / "checkpoints" / "step14", stray / "checkpoints" / "step12",
                     tag="step14", step=14, lineage="another run")
    said = refusal(flags_of(data, stray), monkeypatch)
    assert f"{stray}/checkpoints/step14 is another run's checkpoint (lineage another run; " \
           "this run's is" in said
    assert "--resume-from step12" in said
    plan = accepted(flags_of(data, stray, "--resume-from", "step12")).resume_plan
    assert plan.candidates == (12,) and plan.by_hand

    said = refusal(flags_of(data, reference, "--lr", "1e-3", "--warmup-steps", "3"), monkeypatch)
    assert "optimizer.params.lr: 0.002 in the checkpoint, 0.001 now (--lr)" in said
    assert "scheduler.params.warmup_num_steps: 2 in the checkpoint, 3 now (--warmup-steps)" \
        in said and "add --allow-training-changes" in said
    betas = tmp_path / "betas.json"
    config = json.loads(open(CPU_CONFIG).read())
    config["optimizer"]["params"]["betas"] = [0.8, 0.99]
    betas.write_text(json.dumps(config))
    said = refusal(flags_of(data, reference, "--ds-config", str(betas)), monkeypatch)
    assert "optimizer.params.betas[0]: 0.9 in the checkpoint, 0.8 now" in said
    step12 = str(reference / "checkpoints" / "step12")
    changed = accepted(flags_of(data, reference, "--lr", "1e-3", "--allow-training-changes"))
    assert "optimizer.params.lr: 0.002 in the checkpoint, 0.001 now (--lr)" in \
        "\n".join(same_run.training_changes(step12, changed.training, allow=True))
    said = refusal(flags_of(data, reference, "--steps", "14"), monkeypatch)  # the decay moves
    assert "resuming step12 with --steps 14: step 13 would run at learning rate " in said
    assert "Resume with --steps 12 to keep that schedule, or add --allow-training-changes" in said
    longer = accepted(flags_of(data, reference, "--steps", "14", "--allow-training-changes"))
    assert same_run.training_changes(step12, longer.training, allow=False) == []
    config["optimizer"]["params"].update(betas=[0.9, 0.999], amsgrad=True)
    amsgrad = tmp_path / "amsgrad.json"
    amsgrad.write_text(json.dumps(config))
    said = refusal(flags_of(data, reference, "--ds-config", str(amsgrad),
                            "--allow-training-changes"), monkeypatch)
    assert "which its optimizer state was made with and a resumed run cannot change: " \
           "optimizer.params.amsgrad: None in the checkpoint, True now" in said
    assert f"--out NEW --init-from {step12}" in said
    assert accepted(flags_of(data, tmp_path / "new", "--ds-config", str(amsgrad), "--init-from",
                             step12)).init_plan.step_dir == step12

    said = refusal(flags_of(data, stray, "--resume-from",
                            str(reference / "checkpoints" / "step12")), monkeypatch)
    assert "is not a checkpoint of this run folder" in said and "--init-from" in said
    plan = accepted(flags_of(data, reference, "--resume-from",
                             str(reference / "checkpoints" / "step10"))).resume_plan
    assert plan.candidates == (10,)


@pytest.mark.slow
def test_a_branch_on_two_ranks_with_the_runs_own_schedule_trains_what_the_run_trained(
        data, reference, tmp_path):
    """--init-from step8 --branch on the layout that wrote it (each rank's ZeRO partition and
    random streams loaded by the branch's own path, not a resume's): steps 9-12 as the
    uninterrupted run trained them. (test_a_learning_rate_change_without_a_schedule_holds
    branches in one process.)"""
    step8, branch = reference / "checkpoints" / "step8", tmp_path / "branch"
    said = run(data, branch, *FLAGS, "--init-from", str(step8), "--branch")
    assert f"branched from {step8} at step 8 of 12" in said
    assert_same_losses(branch, reference, steps=range(9, 13))
    assert_same_weights(branch / "checkpoints" / "step12", reference / "checkpoints" / "step12")


@pytest.mark.slow
def test_allowed_training_changes_hold_from_the_first_step(data, reference, tmp_path):
    """--lr and betas changed at a resume, with --allow-training-changes: said, and the
    optimizer uses them (DeepSpeed restores the checkpoint's parameter groups)."""
    changed = tmp_path / "changed"
    shutil.copytree(reference, changed)
    config = json.loads(open(CPU_CONFIG).read())
    config["optimizer"]["params"]["betas"] = [0.8, 0.99]
    betas = tmp_path / "betas.json"
    betas.write_text(json.dumps(config))
    said = run(data, changed, *FLAGS, "--steps", "14", "--lr", "1e-3", "--ds-config", str(betas),
               "--allow-training-changes")
    assert "resuming step12 with changed training settings (--allow-training-changes): " \
           "optimizer.params.lr: 0.002 in the checkpoint, 0.001 now (--lr)" in said
    # step 13 resumed unchanged (--steps 14 --allow-training-changes) runs at WarmupDecayLR's
    # rate: --lr 2e-3 x (14 - (13 - 2)) / (14 - 2 warm-up steps), as test_resume_settings.py's
    # test_a_moved_rate_allowed_is_said_and_trained trains and checks such a resume
    lr_unchanged, lr_changed = 2e-3 * (14 - 11) / (14 - 2), log(changed)[13]["train/lr"]
    assert lr_changed == pytest.approx(lr_unchanged / 2, rel=1e-6)
    shard = safe_load.load(changed / "checkpoints" / "step14" /
                           "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    groups = shard["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [tuple(g["betas"]) for g in groups] == [(0.8, 0.99)] * len(groups)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    # step14 damaged: the fallback, step12, was trained otherwise, which this command must allow
    (changed / "checkpoints" / "step14" / "rng_rank0.pt").write_bytes(b"")
    said = run(data, changed, *FLAGS, "--steps", "14", "--lr", "1e-3", "--ds-config", str(betas),
               expect=1)  # step14's settings and schedule
    assert f"tupe-pretrain: error: {changed}/checkpoints/step12 was trained with other optimizer " \
           "or schedule settings: optimizer.params.betas[0]: 0.9 in the checkpoint, 0.8 now" in said
    assert "exit worker: rank 0, exit code 2" in said and "[rank0]: Traceback" not in said


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_loses_nothing(data, reference,
                                                                             tmp_path):
    """A full disk: for rank 0's manifest alone (after every rank wrote its files), every rank
    stops alike (exit 3), naming the file and the last complete checkpoint; for rank 1's files
    alone, rank 1 stops so and the launcher ends the rank that waits for it. Each time the same
    command then sets the cut-short save aside and ends as the uninterrupted run."""
    out, flags = tmp_path / "run", [*FLAGS, "--keep-checkpoints", "4"]
    said = run(data, out, *flags, fault="disk-full:4:manifest", expect=1)
    assert said.count("could not commit checkpoint step4 (rank 0: [Errno 28] No space left on "
                      f"device: '{out}/checkpoints/step4/manifest.json'); the last complete "
                      "checkpoint is step2") == 1  # said once
    assert "exit worker: rank 0, exit code 3" in said and "exit worker: rank 1, exit code 3" in said
    said = run(data, out, *flags, fault="disk-full:8:1", expect=1)
    assert "step4 (newer than step2" in said and "resumed at step 2 of 12" in said
    assert "could not write checkpoint step8 (rank 1: [Errno 28] No space left on device" in said
    assert "the last complete checkpoint is step6" in said
    said = run(data, out, *flags)
    assert "step8 (newer than step6" in said and "resumed at step 6 of 12" in said
    assert_same_losses(out, reference)
    assert_same_weights(out / "checkpoints" / "step12", reference / "checkpoints" / "step12")


def test_an_export_ships_the_tokenizer_the_run_was_trained_with(data, reference, tmp_path,
                                                                capsys):
    """run.json's data folder holding another tokenizer, or none: refused, naming it; the right
    one given with --tokenizer: exported with it."""
    from tupe_ds.export.write import main as export_main

    run_dir, other = tmp_path / "run", tmp_path / "other-data"
    shutil.copytree(reference, run_dir)
    other.mkdir()
    description = json.loads((run_dir / "run.json").read_text())
    description["data"] = str(other)
    (run_dir / "run.json").write_text(json.dumps(description))
    assert export_main([str(run_dir), "--out", str(tmp_path / "x")]) == 2
    assert f"{other}/tokenizer.json: no tokenizer there" in capsys.readouterr().err
    tokenizer = json.loads((Path(data) / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "[NOT-PAD]"
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert export_main([str(run_dir), "--out", str(tmp_path / "x")]) == 2
    assert f"{other}/tokenizer.json is not the tokenizer {run_dir}/checkpoints/step12 was " \
           "trained with" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert export_main([str(run_dir), "--out", str(tmp_path / "x"), "--tokenizer",
                        str(Path(data) / "tokenizer.json")]) == 0
    shipped = json.loads((tmp_path / "x" / "tokenizer.json").read_text())
    trained = json.loads((Path(data) / "tokenizer.json").read_text())
    assert shipped["model"]["vocab"] == trained["model"]["vocab"]
    assert [t["content"] for t in shipped["added_tokens"]][:5] == ["[PAD]", "[UNK]", "[CLS]",
                                                                   "[SEP]", "[MASK]"]
    assert "`tupe-pretrain --mask-rate 0.15 --mask-split 0.8,0.1`" in \
        (tmp_path / "x" / "README.md").read_text()  # the masking its manifest records


@pytest.mark.slow
def test_a_real_full_disk_stops_the_run_and_loses_nothing(data, reference, tmp_path):
    """The run folder on a small tmpfs, filled while the run trains: the save that cannot be
    written (torch's C++ writer fails, not Python's) stops the run (exit 3) naming the last
    complete checkpoint; with the space freed the same command ends as the uninterrupted run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        out, flags, hold = disk / "run", [*FLAGS, "--keep-checkpoints", "4"], tmp_path / "hold"
        first, output = start(data, out, *flags, fault=f"hold:5:{hold}", logs=tmp_path)
        wait_for(f"{hold}.waiting", first)
        free = os.statvfs(disk)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 200_000))
        hold.touch()
        first.wait(240)
        output.seek(0)
        said = output.read()
        assert "could not write checkpoint step6 (rank" in said, said[-3000:]
        assert "the last complete checkpoint is step4" in said
        assert "exitcode  : 3" in said and "[rank0]: Traceback" not in said  # torchrun's summary
        filler.unlink()
        said = run(data, out, *flags)
        assert "step6 (newer than step4" in said and "resumed at step 4 of 12" in said
        assert_same_losses(out, reference)
        assert_same_weights(out / "checkpoints" / "step12",
                            reference / "checkpoints" / "step12")
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.slow
def test_a_learning_rate_change_without_a_schedule_holds(data, tmp_path, monkeypatch):
    """A config without a scheduler (a constant learning rate): --lr changed at a resume with
    --allow-training-changes is the one the next steps use. Such a run is a stable phase a WSD
    decay branches from (its checkpoint holds no scheduler state: the schedule takes its place
    from the step): the branch goes on with the run's weights, optimizer state and data
    position, its first two losses those of the resumed run (both at the same rate); the same
    command again resumes the branch, and a branch from another checkpoint into its --out is
    refused."""
    config = json.loads(open(CPU_CONFIG).read())
    del config["scheduler"]
    constant = tmp_path / "constant.json"
    constant.write_text(json.dumps(config))
    out = tmp_path / "run"
    flags = ["--ds-config", str(constant), "--save-interval", "2", "--eval-interval", "100",
             "--dropout", "0"]
    run(data, out, *flags, "--steps", "4", "--lr", "2e-3", processes=1)
    said = run(data, out, *flags, "--steps", "6", "--lr", "5e-4", "--allow-training-changes",
               processes=1)
    assert "optimizer.params.lr: 0.002 in the checkpoint, 0.0005 now (--lr)" in said
    assert [log(out)[step]["train/lr"] for step in (4, 5, 6)] == [2e-3, 5e-4, 5e-4]
    branch, step4 = tmp_path / "branch", str(out / "checkpoints" / "step4")
    decay = [*flags, "--steps", "7", "--lr", "5e-4", "--lr-schedule", "wsd", "--warmup-steps",
             "1", "--decay-steps", "2"]
    said = run(data, branch, *decay, "--init-from", step4, "--branch", processes=1)
    assert f"branched from {step4} at step 4 of 7" in said
    assert "branching from step4 with changed training settings: optimizer.params.lr: 0.002 " \
           "in the checkpoint, 0.0005 now (--lr)" in said
    assert [log(branch)[step]["train/lr"] for step in (5, 6, 7)] == [5e-4, 5e-4, 2.5e-4]
    for step in (5, 6):
        assert log(branch)[step]["train/loss"] == pytest.approx(log(out)[step]["train/loss"],
                                                                rel=1e-6)
    common = ["--data", data, "--model", "tiny", "--ds-config", str(constant), "--out",
              str(branch), "--seq-len", "64", *decay, "--branch", "--init-from"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    from tupe_ds.train.config import load
    again = load([*common, step4])  # the same command again: the branch resumes
    assert again.resume_plan.tag == "step7" and again.init_plan is None
    said = refusal([*common, str(out / "checkpoints" / "step6")], monkeypatch, world=1)
    assert f"holds the branch of {step4} (" in said and "give this branch another --out" in said


@pytest.mark.slow
def test_a_preemption_warning_while_the_run_starts_stops_it_cleanly(data, reference, tmp_path):
    """SIGUSR1 (Slurm's warning) to one rank while the engine is built: the run stops before its
    first step (nothing new to save), exit 3 and not requeued (the time limit leaves no time to
    train a step), its lock released."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    said = run(data, out, *FLAGS, "--steps", "14", "--allow-training-changes",
               fault="usr1-at-start:1", expect=1)
    assert "exit worker: rank 0, exit code 3" in said and "exit worker: rank 1, exit code 3" in said
    assert "resumed at step 12 of 14" in said
    assert "stopping before step 13 on SIGUSR1: nothing was trained since step12" in said
    assert "the job is not requeued" in said
    assert steps_in(out) == steps_in(reference) and not (out / "run.lock").exists()
