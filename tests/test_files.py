"""Outputs appear whole or not at all (tupe_ds/tools/files.py); the lock that guards them holds
where flock fails (tupe_ds/tools/lock.py)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from logged import logged_lines
from tupe_ds.tools import lock, settings
from tupe_ds.tools.files import replacing_folder, write_atomically

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_write_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step2")
    write_atomically(str(path), "step4")
    assert path.read_text() == "step4"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_a_failed_folder_leaves_the_old_one(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError):
        with replacing_folder(str(out)) as folder:
            (tmp_path / "export.tmp" / "model.safetensors").write_text("half")
            assert folder == str(tmp_path / "export.tmp")
            raise RuntimeError("killed mid-way")
    assert (out / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_finished_folder_replaces_the_old_one_and_a_leftover_temporary(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    (tmp_path / "export.tmp").mkdir()  # what a killed run left
    (tmp_path / "export.tmp" / "half").write_text("")
    with replacing_folder(str(out)) as folder:
        assert not list((tmp_path / "export.tmp").iterdir())
        (tmp_path / "export.tmp" / "config.json").write_text("{}")
        assert folder == str(tmp_path / "export.tmp")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# --- locked where flock fails (tupe_ds/tools/lock.py) ------------------------------------------

COUNTER = """
import errno, fcntl, os, sys
def no_flock(*args):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
fcntl.flock = no_flock  # Lustre mounted without -o flock
from tupe_ds.tools.files import locked
path = sys.argv[1]
for _ in range(10):
    with locked(path + ".lock"):
        with open(path) as f:
            value = int(f.read())
        with open(path, "w") as f:  # not atomic: a reader outside the lock would see it empty
            f.write(str(value + 1))
"""


def test_locked_without_flock_lets_one_process_in_at_a_time(tmp_path):
    """Four processes whose flock fails with ENOSYS add to one counter under `locked`: the lock
    files made by hard links let one in at a time (no update lost, no half-written read)."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    processes = [subprocess.Popen([sys.executable, "-c", COUNTER, str(counter)], cwd=ROOT,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [process.communicate(timeout=120)[1] for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, errors
    assert counter.read_text() == "40"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter", "counter.lock"]


def test_a_lock_file_held_elsewhere_is_waited_for_then_taken_over_when_its_lease_runs_out(
        tmp_path, monkeypatch):
    """A holder on another node is waited for, saying whom and which file to remove, while its
    lease is renewed; once it has not been for LEASE_SECONDS (a lost node), it is taken over."""
    monkeypatch.setattr(lock, "WAIT_NOTICE_SECONDS", 0.05)
    path = tmp_path / "index.lock.holder"
    path.write_text(json.dumps({**lock.this_holder(), "host": "node-elsewhere", "pid": 4242,
                                "started": "2026-11-26T00:00:00+00:00"}))
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(lock.LinkLock.acquire(str(path), "fix")))
    with logged_lines() as said:
        waiter.start()
        deadline = time.time() + 30
        while not said and time.time() < deadline:
            time.sleep(0.01)
        assert said == [f"tupe_ds: waiting for {path}, held by process 4242 on node-elsewhere, "
                        "started 2026-11-26T00:00:00+00:00 (its lease renewed 0 s ago, taken over "
                        f"once not renewed for {lock.LEASE_SECONDS:.0f} s); "
                        f"if that process is gone, remove {path}"]
        assert not taken
        old = time.time() - lock.LEASE_SECONDS - 60
        os.utime(path, (old, old))  # its holder stopped renewing it
        waiter.join(timeout=30)
    assert taken and said[1].startswith(f"tupe_ds: took over {path} from process 4242 on "
                                        "node-elsewhere") and "(its node is lost)" in said[1]
    assert json.loads(path.read_text())["token"] == taken[0].holder["token"]
    taken[0].release()
    assert list(tmp_path.iterdir()) == []


def test_a_holder_whose_process_proc_hides_counts_as_alive(monkeypatch):
    """/proc mounted with hidepid (shared nodes) shows no other user's process: the kernel is
    asked instead, so a live holder is not taken over and a dead one is."""
    monkeypatch.setattr(lock, "process_start", lambda pid: None)
    here = {**lock.this_holder(), "pid_start": None}
    assert lock.alive_here({**here, "pid": os.getpid()})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert not lock.alive_here({**here, "pid": int(dead.stdout)})


@pytest.mark.parametrize("name, least, default", [("TUPE_DS_LOCK_LEASE_SECONDS", 10, 600.0),
                                                  ("TUPE_DS_READ_RETRY_SECONDS", 0, 120.0)])
@pytest.mark.parametrize("value", ["-5", "nan", "abc", "inf"])
def test_a_setting_that_is_no_number_of_seconds_is_named_and_the_default_used(
        name, least, default, value, capsys, monkeypatch):
    monkeypatch.setenv(name, value)
    assert settings.seconds(name) == default
    assert f"{name}={value!r}" in capsys.readouterr().err
    monkeypatch.setenv(name, "45")
    assert settings.seconds(name) == 45.0
    monkeypatch.setenv(name, str(least))
    assert settings.seconds(name) == least


@pytest.mark.parametrize("name", ["TUPE_DS_GC", "TUPE_DS_COMPILE_AT_IMPORT", "TUPE_DS_VERBOSE"])
def test_a_switch_is_on_off_or_named_and_off(name, capsys, monkeypatch):
    for value, on in (("on", True), ("TRUE", True), ("1", True), ("off", False), ("0", False),
                      ("No", False), ("", False)):
        monkeypatch.setenv(name, value)
        assert settings.switched_on(name) is on, value
    monkeypatch.delenv(name)
    assert settings.switched_on(name) is False
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(name, "maybe")
    assert settings.switched_on(name) is False
    assert f"{name}='maybe'" in capsys.readouterr().err
