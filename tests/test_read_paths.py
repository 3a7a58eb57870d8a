"""Reads of the run folder outside the checkpoint's verification go through
tupe_ds/train/checkpoint/reads.py too: train_log.jsonl (tupe_ds/train/monitor.py), a
checkpoint's listing and layout.json (reshard.py), every safe_load.load (tupe-export's slices
among them). Each is checked to be a regular file (inside the run folder, for the log) and
retried on an OSError, then stops with reads.Unreadable naming it; nothing hangs on a FIFO."""

import errno
import json
import os
import signal

import pytest
import torch

from test_checkpoint import LAYOUT
from test_resume_errors import read_errors  # noqa: F401  (a fixture)
from tupe_ds.export import consolidate
from tupe_ds.model.config import ModelConfig
from tupe_ds.tools.errors import TrainingStopped
from tupe_ds.train import monitor
from tupe_ds.train.checkpoint import reads, reshard, safe_load

LOG_LINES = b'{"step": 2, "time/training_seconds": 1.5}\n{"step": 4}\n'


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO opened) fails the test in 20 s instead of hanging it."""
    def hung(*_):
        raise TimeoutError("a read hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def make_monitor(out, resumed_at=2):
    """Rank 0's Monitor of run folder `out`, resumed at `resumed_at` (closed: its log stays)."""
    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32,
                         vocab_size=16)
    made = monitor.Monitor(str(out), (config,), 8, 1, 0, resumed_at=resumed_at)
    made.close()
    return made


def resume_the_log(out, place):
    place()
    return make_monitor(out)


def read_the_times(out, place):
    place()
    monitor.logged_times(str(out / "train_log.jsonl"), 4)


def log_a_line(out, place):
    """The log placed after the Monitor started: its next line."""
    made = make_monitor(out)
    place()
    made.scalars(6, {"train/loss": 1.0})
    return made


LOG_USES = [resume_the_log, read_the_times, log_a_line]


def failure_of(use, out, place) -> str:
    """What stops the run: what a read raises, or what the Monitor noted for the next agreement
    of every rank (tupe_ds/train/run_folder/files.py)."""
    try:
        made = use(out, place)
    except TrainingStopped as stopped:
        return str(stopped)
    return made.failure


@pytest.mark.parametrize("use", LOG_USES)
def test_a_fifo_at_the_log_stops_rank_0_naming_it_and_does_not_hang(tmp_path, use):
    log = tmp_path / "train_log.jsonl"
    assert failure_of(use, tmp_path, lambda: os.mkfifo(log)) == (
        f"the run's log {log}: not a regular file (a FIFO); tupe_ds reads only regular files "
        "here: remove or replace it")


@pytest.mark.parametrize("use", LOG_USES)
def test_a_log_linked_out_of_the_run_folder_is_neither_read_nor_written(tmp_path, use):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_bytes(LOG_LINES)
    out = tmp_path / "run"
    out.mkdir()
    assert failure_of(use, out, lambda: (out / "train_log.jsonl").symlink_to(elsewhere)).startswith(
        f"the run's log {out}/train_log.jsonl: a symbolic link leading out of {out} ")
    assert elsewhere.read_bytes() == LOG_LINES
    assert not (out / "train_log.redone.jsonl").exists()


def test_a_log_linked_to_nothing_is_not_created_where_it_leads(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert "a symbolic link to nothing" in failure_of(
        log_a_line, out, lambda: (out / "train_log.jsonl").symlink_to(tmp_path / "created.jsonl"))
    assert not (tmp_path / "created.jsonl").exists()


def test_a_log_linked_inside_the_run_folder_is_read_and_trimmed(tmp_path):
    (tmp_path / "kept.jsonl").write_bytes(LOG_LINES)
    (tmp_path / "train_log.jsonl").symlink_to(tmp_path / "kept.jsonl")
    assert make_monitor(tmp_path).seconds["training"] == 1.5
    assert (tmp_path / "train_log.jsonl").read_bytes() == LOG_LINES.splitlines(True)[0]


def test_a_log_the_filesystem_does_not_give_is_retried_then_unreadable(tmp_path, read_errors):
    log = tmp_path / "train_log.jsonl"
    log.write_bytes(LOG_LINES)
    read_errors("train_log.jsonl", times=2)
    assert make_monitor(tmp_path).seconds["training"] == 1.5  # read on the third try
    assert (tmp_path / "train_log.redone.jsonl").read_bytes() == b'{"step": 4}\n'
    log.write_bytes(LOG_LINES)
    read_errors("train_log.jsonl")
    assert make_monitor(tmp_path, resumed_at=0).failure.startswith(
        f"could not read {log} ([Errno 5] Input/output error) for 1 s")
    assert log.read_bytes() == LOG_LINES  # nothing trimmed


@pytest.fixture
def listing_errors(monkeypatch):
    """listing_errors(times): the next `times` os.listdir calls fail with EIO (None: every one)."""
    listed = os.listdir

    def fail(times=None):
        left = [times]

        def listdir_or_eio(path="."):
            if left[0] != 0:
                left[0] = None if left[0] is None else left[0] - 1
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
            return listed(path)

        monkeypatch.setattr(os, "listdir", listdir_or_eio)

    monkeypatch.setenv(reads.RETRY_SECONDS, "1")
    return fail


def checkpoint(tmp_path, zero_shards=True):
    """A step folder with a model file of a module of tensors (and ZeRO's optimizer shard)."""
    step_dir = tmp_path / "step2"
    step_dir.mkdir()
    torch.save({"module": {"weight": torch.ones(2)}}, step_dir / "mp_rank_00_model_states.pt")
    if zero_shards:
        torch.save({}, step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return step_dir


def export_sees_zero_shards(step_dir):
    return bool(consolidate.files_named(step_dir, "*mp_rank_00_optim_states.pt"))


@pytest.mark.parametrize("listing", [reshard.has_zero_shards, export_sees_zero_shards])
def test_a_checkpoint_listing_is_retried_then_unreadable(tmp_path, listing_errors, listing):
    """A listing that failed once would take a ZeRO checkpoint for a whole one (a reshard
    planned wrong, a slice exported from its fp16 module)."""
    step_dir = str(checkpoint(tmp_path))
    listing_errors(times=2)
    assert listing(step_dir)
    listing_errors()
    with pytest.raises(reads.Unreadable, match=f"could not read {step_dir} "):
        listing(step_dir)


def test_layout_json_is_retried_then_unreadable_and_a_fifo_is_no_layout(tmp_path, read_errors):
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(LAYOUT))
    read_errors("layout.json", times=2)
    assert reshard.layout_file(str(tmp_path)) == reshard.SavedLayout(**LAYOUT)
    read_errors("layout.json")
    with pytest.raises(reads.Unreadable, match=f"could not read {path} "):
        reshard.layout_file(str(tmp_path))
    path.unlink()
    assert reshard.layout_file(str(tmp_path)) is None
    os.mkfifo(path)
    with pytest.raises(ValueError, match=f"{path}: not a layout tupe-pretrain wrote .*a FIFO"):
        reshard.layout_file(str(tmp_path))


def test_safe_load_is_retried_then_unreadable_never_damage(tmp_path, read_errors):
    """tupe-export's slices and a verification's scan alike: EIO is not a damaged pickle."""
    step_dir = checkpoint(tmp_path, zero_shards=False)
    path = step_dir / "mp_rank_00_model_states.pt"
    read_errors("model_states.pt", times=2)
    assert torch.equal(consolidate.slice_state(str(step_dir), 0, 1)["weight"], torch.ones(2))
    read_errors("model_states.pt")
    with pytest.raises(reads.Unreadable, match=f"could not read {path} "):
        safe_load.scan(str(path))
    with pytest.raises(reads.Unreadable, match=f"could not read {path} "):
        consolidate.slice_state(str(step_dir), 0, 1)
