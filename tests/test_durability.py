"""A checkpoint is on disk before it counts, and before an older one is deleted: the order of a
real save's fsyncs, its manifest and retention (tupe_ds/train/checkpoint/save.py,
tupe_ds/tools/files.py), recorded on a real DeepSpeed engine in one process."""

import errno
import os
import shutil

import pytest
import torch

from one_process import deepspeed_group  # noqa: F401  (a fixture)
from test_checkpoint import LAYOUT
from test_nonfinite import new_engine
from tupe_ds.tools import files
from tupe_ds.train.checkpoint import history, manifest, reshard, save
from tupe_ds.train.steps import release


@pytest.fixture
def engine(deepspeed_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    built = new_engine(deepspeed_group, "fp32", 2)
    yield built
    release(built)


@pytest.fixture
def events(monkeypatch):
    """What the filesystem was asked, in order: ("fsync", path), ("replace", source, target),
    ("rmtree", path)."""
    happened = []
    fsync, replace, rmtree = os.fsync, os.replace, shutil.rmtree

    def recorded_fsync(descriptor):
        happened.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        return fsync(descriptor)

    def recorded_replace(source, target, **kwargs):
        happened.append(("replace", os.fspath(source), os.fspath(target)))
        return replace(source, target, **kwargs)

    def recorded_rmtree(path, *args, **kwargs):
        happened.append(("rmtree", os.fspath(path)))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    monkeypatch.setattr(shutil, "rmtree", recorded_rmtree)
    return happened


def save_step(engine, directory, step):
    """save.save of `step` into `directory` (CHECKPOINTS), whose run's history its start began
    where there is none."""
    out = os.path.dirname(str(directory))
    if not os.path.exists(os.path.join(out, history.FILE)):
        os.makedirs(out, exist_ok=True)
        history.append(out, [], [history.record("attempt", lineage="mine")])
    save.save(engine, str(directory), step, {"step": step}, 1, reshard.SavedLayout(**LAYOUT),
              {"lineage": "mine", "identity": {}}, torch.device("cpu"))


def test_every_file_is_on_disk_before_the_manifest_and_retention_comes_last(tmp_path, engine,
                                                                            events, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    saved = engine.save_checkpoint

    def and_a_file_of_its_own(directory, tag, **kwargs):  # not through the checkpoint engine
        saved(directory, tag=tag, **kwargs)
        (checkpoints / tag / "notes.txt").write_text("a file DeepSpeed wrote its own way")

    monkeypatch.setattr(engine, "save_checkpoint", and_a_file_of_its_own)
    save_step(engine, checkpoints, 2)
    events.clear()
    save_step(engine, checkpoints, 4)

    step4 = str(checkpoints / "step4")
    listed = manifest.read(step4)["files"]
    assert {"mp_rank_00_model_states.pt", "rng_rank0.pt", reshard.LAYOUT_FILE,
            "notes.txt"} <= set(listed)  # DeepSpeed's, ours, and one found by listing
    manifest_at = next(at for at, event in enumerate(events) if event[0] == "replace" and
                       event[2] == os.path.join(step4, "manifest.json"))
    fsynced = {event[1]: at for at, event in enumerate(events) if event[0] == "fsync"}
    assert [name for name in listed if os.path.join(step4, name) not in fsynced] == []
    last_file = max(fsynced[os.path.join(step4, name)] for name in listed)
    assert last_file < manifest_at
    folder_synced = [at for at, event in enumerate(events) if event == ("fsync", step4)]
    assert any(last_file < at < manifest_at for at in folder_synced), (last_file, folder_synced)
    assert any(at < manifest_at for at, event in enumerate(events)
               if event == ("fsync", str(checkpoints)))
    renamed_durably = min([at for at in folder_synced if at > manifest_at], default=None)
    assert renamed_durably is not None  # the manifest's name

    step2, doomed = str(checkpoints / "step2"), str(checkpoints / ".deleting-step2")
    retired_at = events.index(("replace", step2, doomed))
    assert renamed_durably < retired_at
    removed_at = events.index(("rmtree", doomed))
    assert any(retired_at < at < removed_at for at, event in enumerate(events)
               if event == ("fsync", str(checkpoints)))
    assert not os.path.exists(step2) and not os.path.exists(doomed)


def test_a_file_that_cannot_be_flushed_fails_the_save_before_its_manifest(tmp_path, engine,
                                                                          monkeypatch):
    fsync = os.fsync

    def failing(descriptor):
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith("rng_rank0.pt"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return fsync(descriptor)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(save.SaveFailed, match=r"could not write checkpoint step2 \(rank 0: "
                                              r"\[Errno 5\] Input/output error\)"):
        save_step(engine, tmp_path, 2)
    assert not manifest.exists(str(tmp_path / "step2"))


@pytest.mark.parametrize("code, passed_over", [(errno.EINVAL, True), (errno.EIO, False)])
def test_a_folder_the_filesystem_cannot_flush_is_passed_over_a_failure_is_not(
        tmp_path, monkeypatch, code, passed_over):
    def refused(descriptor):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refused)
    if passed_over:
        files.sync_folder(str(tmp_path))
    else:
        with pytest.raises(OSError, match="Input/output error"):
            files.sync_folder(str(tmp_path))


@pytest.mark.parametrize("harm", ["garbled", "gone"])
def test_a_history_damaged_or_lost_while_the_run_trains_fails_the_save_on_every_rank(
        tmp_path, engine, harm):
    """A history garbled or lost between saves: the next save's commit stops alike on every
    rank (SaveFailed, everywhere), naming the file, before its manifest is written (no
    checkpoint the history does not record), the previous checkpoint still `latest`; no
    traceback of the history's own error."""
    directory = tmp_path / "run" / "checkpoints"
    save_step(engine, directory, 2)
    save_step(engine, directory, 3)  # committed, committed, retired: a first line not the last
    path = tmp_path / "run" / "history.jsonl"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([b"garbled", *lines[1:]]) if harm == "garbled" else b"")
    with pytest.raises(save.SaveFailed) as failed:
        save.save(engine, str(directory), 4, {"step": 4}, 1, reshard.SavedLayout(**LAYOUT),
                  {"lineage": "mine", "identity": {}}, torch.device("cpu"))
    assert failed.value.everywhere
    assert str(failed.value).startswith(f"could not commit checkpoint step4 (rank 0: {path}" + (
        ", line 1: not JSON" if harm == "garbled" else " is gone (or emptied) while the run "
        "trains)"))
    assert failed.value.remedy == save.HISTORY_REMEDY
    assert not manifest.exists(str(directory / "step4"))
    assert (directory / "latest").read_text() == "step3"
