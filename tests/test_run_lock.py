"""One job per run folder (tupe_ds/train/run_folder/lock.py): the lock's rules on real files and
processes of this machine; two tupe-pretrain jobs on one --out: test_run_integrity.py and
test_chaos.py."""

import fcntl
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import time

import pytest

from logged import logged_lines
from tupe_ds.tools import lock as tools_lock
from tupe_ds.tools.errors import RunFolderBusy
from tupe_ds.tools.lock import process_start, this_holder
from tupe_ds.train.run_folder import lock as folder_lock
from tupe_ds.train.run_folder.lock import RunLock


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def plant(out, **holder):
    record = {**this_holder(), "token": "f" * 32,
              "started": "2026-11-26T00:00:00+00:00", **holder}
    (out / folder_lock.LOCK_FILE).write_text(json.dumps(record))
    return record


def test_a_live_holder_refuses_a_second_job_naming_it(tmp_path):
    lock = RunLock.acquire(str(tmp_path))
    try:
        with pytest.raises(RunFolderBusy) as busy:
            RunLock.acquire(str(tmp_path))
        message = str(busy.value)
        assert f"in use by process {os.getpid()} on {socket.gethostname()}" in message
        assert "give this one another --out" in message
        assert "in use by process" in folder_lock.check(str(tmp_path))  # --check-only
        assert lock.still_held() is None
    finally:
        lock.release()
    assert not (tmp_path / folder_lock.LOCK_FILE).exists()
    assert folder_lock.check(str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == []  # no temporary file left behind


def test_a_holder_whose_process_ended_is_taken_over_and_said(tmp_path):
    pid = dead_pid()
    plant(tmp_path, pid=pid)
    with logged_lines() as lines:
        lock = RunLock.acquire(str(tmp_path))
    try:
        assert lines == [f"tupe-pretrain: took over {tmp_path}/run.lock from process {pid} on "
                         f"{socket.gethostname()}, started 2026-11-26T00:00:00+00:00: its "
                         "process has ended"]
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    plant(tmp_path, pid_start=1)  # this process's PID, but a process that started at boot
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert lines and "its process has ended" in lines[0]


def test_another_host_holds_until_its_lease_runs_out(tmp_path, monkeypatch):
    plant(tmp_path, host="node-elsewhere", boot_id="another-boot", pid=12345)
    with pytest.raises(RunFolderBusy, match="in use by process 12345 on node-elsewhere"):
        RunLock.acquire(str(tmp_path))
    old = time.time() - folder_lock.LEASE_SECONDS - 60
    os.utime(tmp_path / "run.lock", (old, old))  # its holder stopped renewing it
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert "its lease was not renewed for" in lines[0] and "(its node is lost)" in lines[0]



def test_a_lease_renewed_in_the_future_counts_as_renewed_now(tmp_path, monkeypatch):
    """A lock renewed three hours "ahead" (its holder's clock fast, on a filesystem that takes
    the client's time) lives LEASE_SECONDS from the first look, not three hours, and no message
    says a negative age; within CLOCK_SKEW_SECONDS it is left as it is."""
    plant(tmp_path, host="node-elsewhere", boot_id="another-boot", pid=12345)
    ahead = time.time() + 10776
    os.utime(tmp_path / "run.lock", (ahead, ahead))
    with pytest.raises(RunFolderBusy) as busy:
        RunLock.acquire(str(tmp_path))
    assert "its lease renewed 0 s ago" in str(busy.value)
    assert "its lease renewed 0 s ago" in folder_lock.check(str(tmp_path))  # --check-only
    assert os.stat(tmp_path / "run.lock").st_mtime < time.time() + 1  # now, for the next look
    monkeypatch.setattr(tools_lock, "LEASE_SECONDS", 0.5)
    time.sleep(1.0)
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert "its lease was not renewed for 1 s (its node is lost)" in lines[0]

    lock = tmp_path / "lock"
    lock.write_text("")
    now = os.stat(lock).st_mtime
    os.utime(lock, (now + 5, now + 5))
    assert tools_lock.lease_age(now, str(lock)) == 0.0
    assert os.stat(lock).st_mtime == now + 5


def test_a_take_over_cut_short_in_the_future_is_cleared_once_stale(tmp_path, monkeypatch):
    """PATH.break left by a taker of another host whose clock is hours ahead: removed
    BREAK_STALE_SECONDS after it is first seen, within the 20 tries of a start."""
    plant(tmp_path, pid=dead_pid())
    breaker = tmp_path / "run.lock.break"
    breaker.write_text(json.dumps({**this_holder(), "host": "node-elsewhere",
                                   "boot_id": "another-boot", "pid": 12345}))
    ahead = time.time() + 10776
    os.utime(breaker, (ahead, ahead))
    monkeypatch.setattr(tools_lock, "BREAK_STALE_SECONDS", 0.5)
    RunLock.acquire(str(tmp_path)).release()
    assert not breaker.exists()

def test_the_same_slurm_job_requeued_takes_over_at_once(tmp_path, monkeypatch):
    """A requeued job (its SLURM_RESTART_COUNT higher) takes its lock over at once; another step
    of the same allocation (the same count) is refused while the holder's lease is fresh."""
    plant(tmp_path, host="node-elsewhere", boot_id="another-boot", pid=12345,
          slurm_job_id="4242", slurm_step_id="0")
    for job, restarts in (("4243", "1"), ("4242", None)):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        if restarts:
            monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
        else:
            monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
        with pytest.raises(RunFolderBusy, match="Slurm job 4242 step 0"):
            RunLock.acquire(str(tmp_path))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert lines[0].endswith("it is this Slurm job (4242) before it was requeued")


def test_a_live_holder_in_another_pid_namespace_holds_by_its_lease(tmp_path):
    """Containers on one host (host network) share its name and boot, not their PIDs: a PID of
    another namespace says nothing here, so the lease decides."""
    plant(tmp_path, pid=dead_pid(), pid_namespace="pid:[1]")
    with pytest.raises(RunFolderBusy, match="its lease renewed 0 s ago"):
        RunLock.acquire(str(tmp_path))


def test_a_stopped_holder_of_this_machine_is_not_promised_a_lease(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        plant(tmp_path, pid=sleeper.pid, pid_start=process_start(sleeper.pid))
        old = time.time() - folder_lock.LEASE_SECONDS - 60
        os.utime(tmp_path / "run.lock", (old, old))
        with pytest.raises(RunFolderBusy) as busy:
            RunLock.acquire(str(tmp_path))
        assert "a live process of this machine" in str(busy.value)
        assert f"kill {sleeper.pid}" in str(busy.value) and "lease" not in str(busy.value)
    finally:
        sleeper.kill()
        sleeper.wait()
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert "its process has ended" in lines[0]


def test_odd_lock_files(tmp_path):
    """A folder named run.lock is refused, named (nothing of the user's is removed); a symbolic
    link, dangling or not, is taken over (the link removed, its target kept); a take-over cut
    short by a kill (run.lock.break of a process that ended) does not block the next job."""
    (tmp_path / "run.lock").mkdir()
    with pytest.raises(RunFolderBusy, match="is a folder, not a lock file"):
        RunLock.acquire(str(tmp_path))
    assert "is a folder, not a lock file" in folder_lock.check(str(tmp_path))  # --check-only
    (tmp_path / "run.lock").rmdir()
    target = tmp_path / "elsewhere"
    for exists in (False, True):
        if exists:
            target.write_text("someone's file")
        (tmp_path / "run.lock").symlink_to(target)
        with logged_lines() as lines:
            RunLock.acquire(str(tmp_path)).release()
        assert "the lock file is damaged" in lines[0]
    assert target.read_text() == "someone's file"
    plant(tmp_path, pid=dead_pid())
    breaker = tmp_path / "run.lock.break"
    breaker.write_text(json.dumps({**this_holder(), "pid": dead_pid()}))
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert "its process has ended" in lines[0] and not breaker.exists()


MALFORMED = [{"pid": 0}, {"pid": -1}, {"pid": True}, {"pid": "12"}, {"pid": 2 ** 40},
             {"host": 5}, {"token": 7}, {"pid_start": "1"}, {"boot_id": 3}, {"slurm_job_id": 41}]


@pytest.mark.parametrize("content", [b"", b"\x00\xff garbage", b"[1, 2]", b'{"token": 5}',
                                     b'{"token": "a", "host": "h", "pid": true}']
                         + [json.dumps({**this_holder(), **field}).encode()
                            for field in MALFORMED])
def test_a_damaged_lock_is_taken_over(tmp_path, content):
    (tmp_path / "run.lock").write_bytes(content)
    with logged_lines() as lines:
        RunLock.acquire(str(tmp_path)).release()
    assert "the lock file is damaged" in lines[0]


def test_a_lock_removed_under_a_run_is_taken_again(tmp_path, capsys):
    lock = RunLock.acquire(str(tmp_path))
    (tmp_path / "run.lock").unlink()
    assert lock.still_held() is None
    assert "was removed while this process held it: taken again" in capsys.readouterr().err
    assert lock.check() is None
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_a_run_taken_over_finds_out_before_it_saves(tmp_path):
    lock = RunLock.acquire(str(tmp_path))
    plant(tmp_path, pid=dead_pid())  # another job's record, as after a take-over
    assert "this run no longer holds its run folder" in lock.still_held()
    assert "now names process" in lock.still_held()
    lock.release()
    assert (tmp_path / "run.lock").exists()  # the new holder's lock is left alone


def test_no_flock_is_needed(tmp_path, monkeypatch):
    """Lustre without -o flock, NFS with local locks: flock and lockf fail; the lock holds."""
    def unavailable(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", unavailable)
    monkeypatch.setattr(fcntl, "lockf", unavailable)
    lock = RunLock.acquire(str(tmp_path))
    with pytest.raises(RunFolderBusy):
        RunLock.acquire(str(tmp_path))
    lock.release()


def contend(out, start, results):
    while time.time() < start:
        pass
    try:
        lock = RunLock.acquire(out)
        results.put(("held", os.getpid()))
        time.sleep(3.0)  # longer than the others' tries
        lock.release()
    except RunFolderBusy as busy:
        results.put(("refused", str(busy)))


@pytest.mark.slow
def test_jobs_racing_for_a_stale_lock_one_wins(tmp_path):
    """Six processes at once, on a lock whose holder died: exactly one takes it over, the
    others are refused naming it (a take-over is exclusive: run.lock.break)."""
    context = multiprocessing.get_context("fork")
    for _ in range(3):
        plant(tmp_path, pid=dead_pid())
        results, start = context.Queue(), time.time() + 0.5
        processes = [context.Process(target=contend, args=(str(tmp_path), start, results))
                     for _ in range(6)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join()
        held = [o for o in outcomes if o[0] == "held"]
        assert len(held) == 1, outcomes
        assert all("in use by process" in o[1] for o in outcomes if o[0] == "refused")
        assert not (tmp_path / "run.lock.break").exists()


def test_a_link_that_answers_eexist_but_was_made_holds(tmp_path, monkeypatch):
    """Over NFS a retransmitted link() that was done answers EEXIST: the lock is this run's all
    the same (its record's link count says so), not refused naming its own process."""
    link = os.link

    def linked_then_eexist(source, target):
        link(source, target)
        raise FileExistsError(17, "File exists", target)

    monkeypatch.setattr(os, "link", linked_then_eexist)
    lock = RunLock.acquire(str(tmp_path))
    assert lock.still_held() is None
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_fifo_at_run_lock_is_refused_without_waiting(tmp_path):
    """A FIFO would hang whoever opens it: refused, named, left in place."""
    os.mkfifo(tmp_path / "run.lock")
    signal.alarm(20)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(RunFolderBusy, match="run.lock is a FIFO, not a lock file tupe_ds "
                                                "wrote: remove it"):
            RunLock.acquire(str(tmp_path))
        assert "is a FIFO, not a lock file" in folder_lock.check(str(tmp_path))  # --check-only
    finally:
        signal.alarm(0)
    assert sorted(os.listdir(tmp_path)) == ["run.lock"]


def test_the_renewal_thread_finds_a_take_over(tmp_path, monkeypatch):
    monkeypatch.setattr(tools_lock, "LEASE_SECONDS", 1.0)  # renewed every 0.1 s
    lock = RunLock.acquire(str(tmp_path))
    plant(tmp_path, host="node-elsewhere", pid=4242)
    deadline = time.time() + 10
    while lock.lost is None and time.time() < deadline:
        time.sleep(0.05)
    assert lock.lost == f"{tmp_path}/run.lock now names process 4242 on node-elsewhere, started " \
                        "2026-11-26T00:00:00+00:00"
    lock.release()


def test_a_lock_file_that_fails_to_read_for_a_moment_neither_stops_the_run_nor_its_renewal(
        tmp_path, monkeypatch):
    """EIO on run.lock (an NFS or Lustre hiccup): the checks before each write retry it, and the
    renewal thread tries again at its next period; only a lock unreadable for the whole retry
    window stops the run (reads.Unreadable, exit 3)."""
    monkeypatch.setattr(tools_lock, "LEASE_SECONDS", 1.0)  # renewed every 0.1 s
    monkeypatch.setenv("TUPE_DS_READ_RETRY_SECONDS", "1")
    lock = RunLock.acquire(str(tmp_path))
    content, failures = tools_lock.lock_content, [0]

    def eio_first(path):
        if failures[0]:
            failures[0] -= 1
            raise OSError(5, "Input/output error", path)
        return content(path)

    monkeypatch.setattr(tools_lock, "lock_content", eio_first)
    failures[0] = 3
    assert lock.still_held() is None
    failures[0] = 3
    renewed = os.stat(lock.path).st_mtime_ns
    deadline = time.time() + 10
    while (failures[0] or os.stat(lock.path).st_mtime_ns == renewed) and time.time() < deadline:
        time.sleep(0.05)
    assert failures[0] == 0 and os.stat(lock.path).st_mtime_ns != renewed  # renewed after EIO
    assert lock._renewer.is_alive() and lock.lost is None
    failures[0] = 10 ** 6
    with pytest.raises(folder_lock.reads.Unreadable, match="could not read .*run.lock"):
        lock.stop_unless_held()
    failures[0] = 0
    lock.release()
