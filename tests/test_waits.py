"""No silent waits: a start-up wait beyond the notice time says what it waits for (the
rendezvous, DeepSpeed's extension builds), and a build lock that no live build holds (left by a
killed build, on which every later run would wait forever) stops tupe-pretrain and tupe-doctor
with where it is and what to do. A wait at a checkpoint barrier: test_multinode.py."""

import json
import os
import subprocess
import sys
import time

import pytest

from runs import CPU_CONFIG, environment, free_port
from tupe_ds.machine import doctor
from tupe_ds.tools.errors import Refused
from tupe_ds.tools import waits
from tupe_ds.train.config import load


def test_a_wait_beyond_the_notice_time_says_what_it_waits_for(monkeypatch, capsys):
    monkeypatch.setattr(waits, "NOTICE_SECONDS", 0.2)
    monkeypatch.setattr(waits, "REPEAT_SECONDS", 10)
    with waits.announced("something quick", rank=3):
        pass
    with waits.announced(lambda: "the other ranks", rank=3):
        time.sleep(0.5)
    assert capsys.readouterr().out == "tupe-pretrain rank 3: waiting 0 s for the other ranks\n"


def lock(root, name="cpu_adam", age=0.0):
    path = root / name / "lock"
    path.parent.mkdir(parents=True)
    path.write_text("")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def holder(path):
    """A process holding `path` open, as torch's FileBaton does while it builds."""
    return subprocess.Popen([sys.executable, "-c", f"f = open({str(path)!r}); import time; "
                             "print('holding', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)


def test_extension_build_locks_no_live_build_holds_are_named_with_the_fix(tmp_path):
    environ = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    stale = lock(tmp_path, "cpu_adam", age=20 * 60)
    fresh = lock(tmp_path, "fused_adam", age=5)
    held = lock(tmp_path, "deepspeed_shm_comm", age=20 * 60)
    building = holder(held)
    try:
        assert building.stdout.readline() == "holding\n"
        findings = {f.text.split(":")[0]: f for f in doctor.extension_lock_findings(environ)}
    finally:
        building.kill()
    assert findings[str(stale)].fatal
    assert "20 minutes old and held by no process on this machine" in findings[str(stale)].text
    assert f"remove it: rm {stale}" in findings[str(stale)].text
    assert not findings[str(fresh)].fatal  # another machine sharing the folder may be building
    assert "another machine sharing this folder may be building" in findings[str(fresh)].text
    assert not findings[str(held)].fatal
    assert f"process {building.pid} is building" in findings[str(held)].text


def test_a_lock_on_a_shared_filesystem_is_not_called_stale(tmp_path, monkeypatch):
    """Another node's build does not show in this machine's process table: on NFS (or Lustre,
    BeeGFS...) an old lock nobody here holds is a warning saying so, not a refusal."""
    from tupe_ds.machine import extension_locks

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home {tmp_path / 'home'} nfs4 rw 0 0\n")
    filesystem_type = extension_locks.filesystem_type
    monkeypatch.setattr(extension_locks, "filesystem_type",
                        lambda path: filesystem_type(path, mounts=str(mounts)))
    old = lock(tmp_path / "home" / "extensions", "cpu_adam", age=20 * 60)
    local = lock(tmp_path / "local", "cpu_adam", age=20 * 60)
    shared, = doctor.extension_lock_findings({"TORCH_EXTENSIONS_DIR": str(old.parent.parent)})
    assert not shared.fatal
    assert "on a nfs4 filesystem, where a build on another node does not show" in shared.text
    assert f"remove it: rm {old}" in shared.text
    here, = doctor.extension_lock_findings({"TORCH_EXTENSIONS_DIR": str(local.parent.parent)})
    assert here.fatal and "the lock of a build that was killed" in here.text


def test_tupe_pretrain_refuses_a_stale_lock_before_any_work(data, tmp_path, monkeypatch):
    stale = lock(tmp_path / "extensions", age=20 * 60)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with pytest.raises(Refused, match=f"{stale}: .* rm {stale}"):
        load(["--data", data, "--ds-config", CPU_CONFIG, "--out", str(tmp_path / "run"),
              "--steps", "1", "--model", "tiny"])
    assert not (tmp_path / "run").exists()


def waiting_line(env, data, out, config=CPU_CONFIG):
    """Start one rank of tupe-pretrain with a notice time of 1 s; its first "waiting" line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tupe_ds.pretrain", "--data", data, "--ds-config", config,
         "--out", str(out), "--steps", "1", "--model", "tiny", "--seq-len", "64"],
        env={**environment(), "TUPE_DS_WAIT_NOTICE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": free_port(), "LOCAL_RANK": "0", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        for line in process.stdout:
            if "waiting" in line or time.time() > deadline:
                return line
        return process.communicate()[0]
    finally:
        os.killpg(process.pid, 9)
        process.wait()


@pytest.mark.slow
def test_a_rank_waiting_for_the_others_at_the_rendezvous_says_so(data, tmp_path):
    line = waiting_line({"RANK": "1", "WORLD_SIZE": "2"}, data, tmp_path / "run")
    assert line.startswith("tupe-pretrain rank 1: waiting "), line
    assert "for the rendezvous of 2 processes at 127.0.0.1:" in line


@pytest.mark.slow
def test_a_run_waiting_on_another_process_s_extension_build_names_it(data, tmp_path):
    """DeepSpeed's FusedAdam (`"torch_adam": false`), which it builds for the CPU too, while
    another process holds the build's lock."""
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    config["optimizer"]["params"]["torch_adam"] = False
    fused_adam = tmp_path / "fused_adam.json"
    fused_adam.write_text(json.dumps(config))
    extensions = tmp_path / "extensions"
    held = lock(extensions, "fused_adam")
    building = holder(held)
    try:
        assert building.stdout.readline() == "holding\n"
        line = waiting_line({"RANK": "0", "WORLD_SIZE": "1",
                             "TORCH_EXTENSIONS_DIR": str(extensions)}, data, tmp_path / "run",
                            str(fused_adam))
    finally:
        building.kill()
    assert line.startswith("tupe-pretrain rank 0: waiting "), line
    assert f"{held}: process {building.pid} is building this DeepSpeed extension" in line
