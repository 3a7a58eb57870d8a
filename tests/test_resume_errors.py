"""What a resume does with what is not damage, and with damage everywhere
(tupe_ds/train/checkpoint/reads.py, resume.py): a read error is retried, then stops the run with
nothing moved; a file the installed software cannot load is a refusal naming both versions; a
folder of checkpoints none of which can be resumed is refused unless --fresh-start; --resume-from
applies once. On made-up checkpoints in this process (a one-process group where a collective is
needed); whole runs: test_run_integrity.py, test_slurm.py."""

import builtins
import errno
import json
import os
import shutil
import time
import types

import pytest
import torch

from one_process import deepspeed_group  # noqa: F401
from test_checkpoint import LAYOUT
from logged import logged_lines
from tupe_ds.tools.errors import Refused
from tupe_ds.train.checkpoint import (folder, history, loading, manifest, reads, resume,
                                      safe_load)


def checkpoint(out, step, lineage="mine", software=None):
    """OUT/checkpoints/stepN whose one file, a pickle of a tensor, its manifest lists."""
    step_dir = out / "checkpoints" / f"step{step}"
    step_dir.mkdir(parents=True)
    torch.save({"step": torch.tensor(step)}, step_dir / "mp_rank_00_model_states.pt")
    manifest.write(str(step_dir), {
        "tag": f"step{step}", "step": step, "id": history.new_id(), "lineage": lineage,
        "identity": {}, "layout": LAYOUT, "files": manifest.describe(str(step_dir), ["mp_rank_00_model_states.pt"]),
        "software": software or safe_load.software_versions()})
    return step_dir


def commit(out, step, **fields):
    """checkpoint(), recorded in the run's history as a save records it (save.py)."""
    step_dir = checkpoint(out, step, **fields)
    record = manifest.read(str(step_dir))
    history.append(str(out), history.read(str(out)) or [], [history.record(
        "committed", id=history.checkpoint_id(record), step=step, lineage=record["lineage"],
        files=record["files"])])
    return step_dir


def newest_id(out, step):
    return history.checkpoint_id(manifest.read(str(out / "checkpoints" / f"step{step}")))


def plan(out, resume_from=None, fresh_start=False, giving_up=None):
    return resume.plan_resume(str(out), "auto", resume_from, 1, 1, 1, 2, fresh_start=fresh_start,
                              giving_up=giving_up)


def choose(out, **flags):
    with logged_lines() as said:
        return resume.choose(plan(out, **flags), 1, 1, 1, 2), said


def everything_in(out):
    return sorted(os.path.relpath(os.path.join(root, name), out)
                  for root, folders, files in os.walk(out) for name in folders + files)


@pytest.fixture
def read_errors(monkeypatch):
    """read_errors(PATH_PART, times): the next `times` opens of files whose path holds PATH_PART
    fail with EIO (None: every one)."""
    opened = builtins.open

    def fail(part, times=None):
        left = [times]

        def open_or_eio(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and part in os.fspath(file) and left[0] != 0:
                left[0] = None if left[0] is None else left[0] - 1
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(file))
            return opened(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_or_eio)

    monkeypatch.setenv(reads.RETRY_SECONDS, "1")
    return fail


def test_a_read_error_is_retried_and_said_once_then_stops_naming_the_file(tmp_path, read_errors,
                                                                          capsys):
    path = tmp_path / "manifest.json"
    path.write_text("{}")
    read_errors("manifest.json", times=3)
    assert reads.read_bytes(str(path)) == b"{}"
    assert capsys.readouterr().err == (f"tupe-pretrain: reading {path} failed ([Errno 5] "
                                       "Input/output error); trying again for up to 1 s\n")
    read_errors("manifest.json")
    with pytest.raises(reads.Unreadable) as stopped:
        reads.read_bytes(str(path))
    assert str(stopped.value) == (f"could not read {path} ([Errno 5] Input/output error) for 1 s: "
                                  "nothing was moved or deleted; run the same command once the "
                                  "filesystem answers")
    assert capsys.readouterr().err.count("trying again") == 1
    with pytest.raises(FileNotFoundError):  # missing is the caller's to say, at once
        reads.read_bytes(str(tmp_path / "missing"))


def test_unreadable_manifests_stop_the_plan_not_make_it_start_over(tmp_path, read_errors,
                                                                   monkeypatch, data, capsys):
    """EIO on every manifest before any process starts: not "no checkpoint", not damage; and
    tupe-pretrain exits 3 with the line, the folder as it was."""
    from tupe_ds.pretrain import main
    from runs import CPU_CONFIG

    out = tmp_path / "run"
    for step in (2, 4):
        checkpoint(out, step)
    before = everything_in(out)
    read_errors("manifest.json")
    with pytest.raises(reads.Unreadable, match="could not read .*/step2/manifest.json"):
        plan(out)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0")  # main sets it: undone after
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--data", data, "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out),
                 "--steps", "6", "--seq-len", "64"]) == 3
    said = capsys.readouterr().err.splitlines()  # the retry's warning, then the stop
    retried, stopped = said[0], said[-1]
    assert "Traceback" not in "".join(said)
    assert retried.startswith(f"tupe-pretrain: reading {out}/checkpoints/step2/manifest.json "
                              "failed ([Errno 5] Input/output error); trying again")
    assert stopped.startswith(f"tupe-pretrain: could not read {out}/checkpoints/step2/"
                              "manifest.json ([Errno 5] Input/output error) for 1 s: nothing was "
                              "moved")
    assert everything_in(out) == before


def test_unreadable_files_stop_every_rank_with_nothing_set_aside(tmp_path, read_errors,
                                                                 deepspeed_group):
    out = tmp_path / "run"
    for step in (2, 4):
        commit(out, step)
    (out / "checkpoints" / "step6").mkdir()  # a save cut short: set aside only when resuming
    before = everything_in(out)
    read_errors("model_states.pt")
    with pytest.raises(reads.Unreadable) as stopped:
        choose(out)
    assert stopped.value.everywhere
    assert str(stopped.value).startswith(f"could not read {out}/checkpoints/step4/mp_rank_00_"
                                         "model_states.pt ([Errno 5] Input/output error) for 1 s")
    assert everything_in(out) == before


def test_a_failed_deepspeed_load_stops_with_the_line_not_a_traceback(tmp_path, deepspeed_group):
    out = tmp_path / "run"
    commit(out, 2)
    chosen = plan(out)

    class Engine:
        def load_checkpoint(self, load_dir, **_):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE),
                          os.path.join(load_dir, "step2", "mp_rank_00_model_states.pt"))

    with pytest.raises(reads.Unreadable, match=f"could not read {out}/checkpoints/step2/mp_rank_00"
                                               r"_model_states.pt \(\[Errno 116\] Stale file "
                                               "handle\\): nothing was moved or deleted"):
        loading.load(Engine(), chosen, seed=1)


class Renamed:
    """A class of the software that wrote a checkpoint, which this one does not load."""


def test_a_file_of_other_software_is_refused_naming_both_versions_never_damage(
        tmp_path, deepspeed_group):
    """A pickle naming a class the installed software does not load, whose checksum the
    manifest agrees with: refused with both versions when other versions wrote it (nothing
    moved); damage, as a planted pickle, when these did."""
    out = tmp_path / "run"
    installed = safe_load.software_versions()
    older = {**installed, "deepspeed": "0.9.0"}
    for step, software in ((2, installed), (4, older)):
        step_dir = commit(out, step, software=software)
        torch.save({"scaler": Renamed()}, step_dir / "mp_rank_00_model_states.pt")
        record = manifest.read(step_dir)
        record["files"] = manifest.describe(str(step_dir), ["mp_rank_00_model_states.pt"])
        manifest.write(str(step_dir), record)
    before = everything_in(out)
    with pytest.raises(Refused) as refused:
        choose(out)
    assert str(refused.value).startswith(
        f"{out}/checkpoints/step4/mp_rank_00_model_states.pt names test_resume_errors.Renamed, "
        "which the installed software does not load; the checkpoint was written by deepspeed "
        f"0.9.0 and this is deepspeed {installed['deepspeed']}. Resume it with the versions that "
        "wrote it")
    assert everything_in(out) == before
    problems = manifest.check_files(str(out / "checkpoints" / "step2"),
                                    manifest.read(out / "checkpoints" / "step2")["files"],
                                    installed)
    assert problems[0].endswith("holds more than tensors and the types tupe_ds's checkpoints "
                                "hold (it names test_resume_errors.Renamed); it is not loaded, "
                                "since unpickling it could run code. If you trust its source, "
                                "load it with torch.load(weights_only=False) yourself")


def test_checkpoints_none_of_which_verify_are_refused_unless_fresh_start(tmp_path,
                                                                        deepspeed_group):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    size = {}
    for step in (2, 4):
        (commit(out, step) / "mp_rank_00_model_states.pt").write_bytes(b"x")
        size[step] = manifest.read(checkpoints / f"step{step}")["files"][
            "mp_rank_00_model_states.pt"]["size"]
    before = everything_in(out)
    with pytest.raises(Refused) as refused:
        choose(out)
    assert str(refused.value) == (
        f"{checkpoints} holds checkpoints of which none can be resumed: step4: {checkpoints}/step4/"
        f"mp_rank_00_model_states.pt: 1 bytes where the manifest says {size[4]} (truncated or "
        f"rewritten); step2: {checkpoints}/step2/mp_rank_00_model_states.pt: 1 bytes where the "
        f"manifest says {size[2]} (truncated or rewritten). Nothing was moved or deleted. Mend "
        "them (restore their files) and run the same command; or, to start this run over from "
        f"step 0, add --fresh-start --giving-up {newest_id(out, 4)} (they are then set aside in "
        f"{checkpoints}/set-aside, not deleted)")
    assert everything_in(out) == before
    with pytest.raises(Refused) as refused:  # the older one by hand: it names the way on too
        choose(out, resume_from="step2")
    assert str(refused.value).endswith(
        "--resume-from step2: the checkpoint does not verify (above). Restore its files and run "
        "the same command; or choose another; or, where none verifies, start this run over from "
        f"step 0: --fresh-start --giving-up {newest_id(out, 4)} (what is there is set aside, not "
        "deleted)")
    assert everything_in(out) == before
    chosen, said = choose(out, fresh_start=True)
    assert chosen is None
    assert (f"tupe-pretrain: no checkpoint of {checkpoints} can be resumed (above): starting anew "
            "from step 0 (--fresh-start); they are set aside, not deleted") in said
    assert folder.step_folders(str(checkpoints)) == []
    assert len(os.listdir(checkpoints / "set-aside")) == 1
    consent = [r for r in history.read(str(out)) if r["kind"] == "consent"]
    assert [(r["flag"], r["outcome"], len(r["gives_up"])) for r in consent] == [
        ("--fresh-start", "applied", 2)]


def test_damaged_manifests_alone_are_refused_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    (checkpoint(out, 2) / "manifest.json").write_text("[")
    history.append(str(out), [], [history.record("attempt", lineage="mine")])
    (out / "checkpoints" / "step4").mkdir()  # incomplete: not a checkpoint
    with pytest.raises(ValueError, match=f"holds checkpoints of which none can be resumed: step4: "
                                         f"no manifest.json \\(not complete\\); step2: {out}/"
                                         "checkpoints/step2/manifest.json: not readable"):
        plan(out)
    assert plan(out, fresh_start=True).candidates == ()
    (out / "checkpoints" / "step2" / "manifest.json").unlink()
    assert plan(out) is None  # this run's history: only saves cut short


def test_a_run_that_committed_checkpoints_never_starts_over_when_they_are_gone(tmp_path,
                                                                               read_errors):
    """The history records the checkpoints committed: a folder that then shows none (moved, or
    a listing that failed) is refused unless --fresh-start; one whose manifest the filesystem
    hides for a moment (ENOENT) is waited for."""
    out = tmp_path / "run"
    commit(out, 2)
    id_2 = newest_id(out, 2)
    os.rename(out / "checkpoints", out / "moved")
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == (
        f"the run's history records step2 as committed (id {id_2}), but the folder holds none "
        "of it (was it moved or lost? a folder set aside by hand is not given up). Nothing was "
        "moved or deleted. Put it back and run the same command; or start over from step 0: "
        f"--fresh-start --giving-up {id_2}")
    assert plan(out, fresh_start=True, giving_up=id_2).candidates == ()
    os.rename(out / "moved", out / "checkpoints")
    manifest_of_2 = str(out / "checkpoints" / "step2" / "manifest.json")
    stat = os.stat

    def enoent_twice(path, *args, **kwargs):
        if os.fspath(path) == manifest_of_2 and hidden[0]:
            hidden[0] -= 1
            raise FileNotFoundError(2, "No such file or directory", manifest_of_2)
        return stat(path, *args, **kwargs)

    hidden = [2]
    read_errors("nothing")  # TUPE_DS_READ_RETRY_SECONDS=1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", enoent_twice)
        assert plan(out).candidates == (2,)


def test_resume_from_repeated_after_the_history_is_lost_is_refused_not_applied_again(
        tmp_path, deepspeed_group):
    """The job's script repeats --resume-from step2; the history is lost after it was spent:
    the start is refused with nothing moved (the history alone tells what was spent and what
    was committed), naming the command that goes on from the newest checkpoint there; that
    command proceeds, and, repeated, is spent."""
    out = tmp_path / "run"
    for step in (2, 4):
        commit(out, step)
    chosen, said = choose(out, resume_from="step2")
    assert chosen.candidates == (2,) and chosen.by_hand
    commit(out, 4), commit(out, 6)  # the resumed run's next checkpoints
    os.remove(out / history.FILE)
    before = everything_in(out)
    id_6 = newest_id(out, 6)
    with pytest.raises(ValueError) as refused:
        plan(out, "step2")
    assert str(refused.value) == (
        f"{out}/history.jsonl is not there (or empty), and {out}/checkpoints holds set-aside; "
        "step2; step4; step6: the history alone tells whether a newer checkpoint was committed "
        "and lost, and which --resume-from or --fresh-start were spent, so the run is not "
        "guessed from the folder. Nothing was moved or deleted. Put back the history as it was "
        "last written (an older copy of it cannot tell either) and run the same command; or go "
        "on from the newest complete checkpoint deliberately, giving up whatever newer was lost: "
        f"--resume-from step6 --giving-up {id_6} (an older one of the run: --resume-from stepK "
        "with the same --giving-up)")
    for flags in ({}, {"fresh_start": True}, {"resume_from": "step6", "giving_up": "other"}):
        with pytest.raises(ValueError, match="history.jsonl is not there"):
            plan(out, **flags)
    assert everything_in(out) == before
    assert plan(out, "step4", giving_up=id_6).candidates == (4,)  # an older one, deliberately
    chosen, said = choose(out, resume_from="step6", giving_up=id_6)
    assert chosen.candidates == (6,) and chosen.by_hand
    assert [(r["kind"], r.get("step")) for r in history.read(str(out))] == [
        ("committed", 2), ("committed", 4), ("committed", 6), ("consent", None)]
    again = plan(out, "step6", giving_up=id_6)  # the script keeps it
    assert again.candidates == (6, 4, 2) and not again.by_hand
    assert again.notes[0].startswith("tupe-pretrain: --resume-from step6 was spent by an earlier "
                                     "attempt") and again.notes[0].endswith(
        "not applied again. It was given on the run as it is now")


def test_check_only_lists_what_is_where_and_what_a_run_would_resume(tmp_path):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    for step in (2, 4):
        commit(out, step)
    (checkpoint(out, 6) / "manifest.json").write_text("[")
    (checkpoints / "step8").mkdir()
    folder.set_aside(str(checkpoints), [8], "in the way")
    kept = next((checkpoints / "set-aside").iterdir()) / "step8"
    assert resume.what_is_where(str(out), plan(out)) == [
        f"{checkpoints}/step2: complete (lineage mine)",
        f"{checkpoints}/step4: complete (lineage mine)",
        f"{checkpoints}/step6: damaged ({checkpoints}/step6/manifest.json: not readable as a "
        "manifest (Expecting value: line 1 column 2 (char 1)))",
        f"{kept}: set aside (never resumed from, never deleted by tupe_ds)",
        "a run would resume step4 once its files verify; else, in turn: step2, a refusal, with "
        "nothing moved",
        f"resuming step4, it would set aside step6 (into {checkpoints}/set-aside, not deleted)"]
    assert resume.what_is_where(str(tmp_path / "new"), None) == [
        f"{tmp_path}/new/checkpoints: no checkpoint", "a run would start from step 0"]


def test_a_full_disk_while_setting_aside_stops_the_start_naming_the_checkpoint(
        tmp_path, deepspeed_group, monkeypatch):
    """No room for set-aside/ (a full disk, an inode quota): Unreadable (exit 3 on every rank)
    naming the folders and the checkpoint resumed, nothing moved; with room, the same command
    finishes the move the history records and resumes that checkpoint."""
    out = tmp_path / "run"
    for step in (2, 4, 6):
        commit(out, step)
    makedirs = os.makedirs

    def full(path, *args, **kwargs):
        if "set-aside" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", full)
    with pytest.raises(reads.Unreadable) as stopped:
        choose(out, resume_from="step4")
    assert str(stopped.value).startswith(
        f"could not set aside step6 in {out}/checkpoints ([Errno 28] No space left on device")
    assert str(stopped.value).endswith(
        "nothing was deleted, and the newest intact checkpoint is step4: run the same command "
        "once the filesystem lets it (space, quota, or what is in the way)")
    assert folder.step_folders(str(out / "checkpoints")) == [2, 4, 6]
    monkeypatch.setattr(os, "makedirs", makedirs)
    chosen, said = choose(out, resume_from="step4")
    assert chosen.candidates[0] == 4 and folder.step_folders(str(out / "checkpoints")) == [2, 4]


def test_resume_from_applies_once_to_the_state_it_was_given_on(tmp_path, deepspeed_group):
    """--resume-from step2 spent: the same flag again resumes the newest checkpoint, saying
    why and the exact command that goes back once more; another --resume-from applies; a
    --giving-up that names no longer the newest is not applied."""
    out = tmp_path / "run"
    for step in (2, 4, 6):
        commit(out, step)
    chosen, _ = choose(out, resume_from="step2")
    assert chosen.candidates == (2,)
    assert folder.step_folders(str(out / "checkpoints")) == [2]
    assert plan(out, "step2").candidates == (2,)  # nothing written since
    for step in (4, 6):
        commit(out, step)
    again = plan(out, "step2")
    assert again.candidates == (6, 4, 2) and not again.by_hand
    assert again.notes[0].endswith(f"not applied again. To apply it to the run as it is now: "
                                   f"--resume-from step2 --giving-up {newest_id(out, 6)}")
    assert plan(out, "step4").candidates == (4,)
    stale = plan(out, "step4", giving_up=newest_id(out, 2))
    assert stale.candidates == (6, 4, 2) and "is step2, not the run's newest" in stale.notes[0]


def test_fresh_start_and_resume_from_are_refused_together():
    from tupe_ds.train.flags import check_flags, parser

    args = parser().parse_args(["--data", "d", "--ds-config", "c", "--out", "o", "--steps", "1",
                                "--resume-from", "step2", "--fresh-start"])
    with pytest.raises(Refused, match="--resume-from with --fresh-start: choose one"):
        check_flags(args)


def test_export_of_an_unreadable_checkpoint_stops_with_the_line_not_a_traceback(
        tmp_path, read_errors, capsys):
    from tupe_ds.export.write import main as export_main
    step_dir = checkpoint(tmp_path, 2)
    (tmp_path / "run.json").write_text("{}")
    read_errors("run.json")
    assert export_main([str(step_dir), "--out", str(tmp_path / "exported")]) == 3
    said = capsys.readouterr().err.splitlines()  # the retry's warning, then the stop
    assert said[-1].startswith(f"tupe-export: could not read {tmp_path}/run.json ([Errno 5]")
    assert "Traceback" not in "".join(said)
    assert not (tmp_path / "exported").exists()


def test_a_listed_file_the_filesystem_hides_for_a_moment_is_waited_for_not_missing(
        tmp_path, read_errors, monkeypatch):
    step_dir = checkpoint(tmp_path, 2)
    files = manifest.read(str(step_dir))["files"]
    read_errors("nothing")  # TUPE_DS_READ_RETRY_SECONDS=1
    stat, hidden = os.stat, [2]

    def enoent_twice(path, *args, **kwargs):
        if os.fspath(path).endswith(".pt") and hidden[0]:
            hidden[0] -= 1
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", enoent_twice)
    assert manifest.check_files(str(step_dir), files) == []
    hidden[0] = 1000
    assert manifest.check_files(str(step_dir), files) == [
        f"{step_dir}/mp_rank_00_model_states.pt: missing"]


@pytest.mark.slow
def test_the_newest_checkpoint_the_history_records_gone_is_refused_not_an_older_one_resumed(
        tmp_path):
    """A run never goes back quietly: the history's newest checkpoint missing while older ones
    are there is refused, naming the deliberate way back; a folder of the same step number set
    aside does not stand in for it (checkpoints are told by id), nor does moving it there by
    hand; set aside by tupe_ds (recorded in the history), it is accounted for. --resume never refuses over a folder whose history records a commit."""
    out = tmp_path / "run"
    for step in (2, 4):
        commit(out, step)
    id_4 = newest_id(out, 4)
    os.rename(out / "checkpoints" / "step4", tmp_path / "step4")
    refusal = (f"the run's history records step4 as committed (id {id_4}), but the folder holds "
               "none of it (was it moved or lost? a folder set aside by hand is not given up). "
               "Nothing was moved or deleted. Put it back and run the same command; or go on from "
               f"step2 deliberately, giving up step4: --resume-from step2 --giving-up {id_4}")
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == refusal
    assert plan(out, "step2", giving_up=id_4).candidates == (2,)
    other_4 = tmp_path / "other" / "checkpoints" / "step4"
    checkpoint(tmp_path / "other", 4)
    (out / "checkpoints" / "set-aside" / "20261127T000000Z").mkdir(parents=True)
    os.rename(other_4, out / "checkpoints" / "set-aside" / "20261127T000000Z" / "step4")
    with pytest.raises(ValueError) as refused:
        plan(out)  # another step4 set aside: still not the one committed
    assert str(refused.value) == refusal
    (out / "checkpoints" / "set-aside" / "20261128T000000Z").mkdir(parents=True)
    os.rename(tmp_path / "step4", out / "checkpoints" / "set-aside" / "20261128T000000Z" / "step4")
    with pytest.raises(ValueError) as refused:
        plan(out)  # the very step4, set aside by hand: no consent to give it up
    assert str(refused.value) == refusal
    history.append(str(out), history.read(str(out)), [history.record(
        "set_aside", id=id_4, step=4)])  # as tupe_ds sets a folder aside: recorded first
    assert plan(out).candidates == (2,)
    with pytest.raises(ValueError, match="--resume never, and it holds checkpoints"):
        resume.plan_resume(str(out), "never", None, 1, 1, 1, 2)
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(ValueError, match="--resume never, and it holds checkpoints of a run "
                                         r"\(its history records step2\)"):
        resume.plan_resume(str(out), "never", None, 1, 1, 1, 2)


def test_files_gone_from_a_checkpoint_are_waited_for_once_not_once_each(tmp_path, monkeypatch):
    step_dir = checkpoint(tmp_path, 2)
    for name in ("rng_rank0.pt", "rng_rank1.pt"):
        torch.save({}, step_dir / name)
    record = manifest.read(str(step_dir))
    record["files"].update(manifest.describe(str(step_dir), ["rng_rank0.pt", "rng_rank1.pt"]))
    manifest.write(str(step_dir), record)
    for path in step_dir.glob("*.pt"):
        path.unlink()
    monkeypatch.setenv(reads.RETRY_SECONDS, "1")
    started = time.monotonic()
    assert len(manifest.check_files(str(step_dir), record["files"])) == 3
    assert time.monotonic() - started < 2  # 3 s with a window per file


def test_a_lost_history_never_lets_a_folder_go_back_or_become_another_run(tmp_path,
                                                                         deepspeed_group):
    """With the history lost, whatever the folder shows is refused, nothing moved, unless a
    consent names its newest checkpoint: every checkpoint lost too (`latest` or a folder set
    aside left), a newest lost behind a same-numbered folder set aside, another run's newer
    checkpoint copied in (whose lineage then names the run: the older ones are not adopted)."""
    out = tmp_path / "run"
    for step in (2, 4, 6):
        commit(out, step)
    checkpoints = out / "checkpoints"
    (checkpoints / "latest").write_text("step6")
    folder.set_aside(str(checkpoints), [6], "newer than step4, --resume-from")
    commit(out, 6)  # the run goes on: a new step6, then it is lost with the history
    shutil.rmtree(checkpoints / "step6")
    os.remove(out / history.FILE)
    before = everything_in(out)
    for flags in ({}, {"fresh_start": True}, {"resume_from": "step2"}):
        with pytest.raises(ValueError, match="holds latest; set-aside; step2; step4: .* --resume-"
                                             f"from step4 --giving-up {newest_id(out, 4)}"):
            plan(out, **flags)
    for step in (2, 4):
        shutil.rmtree(checkpoints / f"step{step}")
    with pytest.raises(ValueError, match="holds latest; set-aside: .*start this run over from "
                                         "step 0: --fresh-start \\(what is there is set aside"):
        plan(out)
    assert everything_in(out) != before and plan(out, fresh_start=True).candidates == ()

    kept = tmp_path / "kept"  # a consent a job's script kept from an earlier lost history
    commit(kept, 2), commit(kept, 4)
    os.remove(kept / history.FILE)
    id_4 = newest_id(kept, 4)
    assert choose(kept, resume_from="step4", giving_up=id_4)[0].candidates == (4,)
    commit(kept, 6)
    (kept / "checkpoints" / "latest").write_text("step6")  # as the save of step6 writes it
    shutil.rmtree(kept / "checkpoints" / "step6")  # lost with the history again
    os.remove(kept / history.FILE)
    with pytest.raises(ValueError, match="\\(its latest names step6, which it does not hold\\)"
                                         ".* remove .*/latest and go on from the newest "
                                         "complete checkpoint .*--resume-from step4"):
        plan(kept, "step4", giving_up=id_4)
    aside = kept / "checkpoints" / "set-aside" / "T"
    (aside / "step6").mkdir(parents=True)
    os.utime(kept / "checkpoints" / "latest", (2_000, 2_000))
    os.utime(aside, (3_000, 3_000))  # a step6 set aside after `latest` named it: no loss
    assert plan(kept, "step4", giving_up=id_4).candidates == (4,)
    os.utime(aside, (1_000, 1_000))  # set aside before: an older step6 than the one lost
    with pytest.raises(ValueError, match="its latest names step6"):
        plan(kept, "step4", giving_up=id_4)
    os.remove(kept / "checkpoints" / "latest")  # what the refusal says to do to go on
    assert plan(kept, "step4", giving_up=id_4).candidates == (4,)
    for step in (2, 4):  # none complete now: a bare --fresh-start neither passes over step6
        (kept / "checkpoints" / f"step{step}" / "manifest.json").write_text("garbage")
    (kept / "checkpoints" / "latest").write_text("step6")
    with pytest.raises(ValueError, match="\\(its latest names step6, which it does not hold\\)"
                                         ".* remove .*/latest and start this run over from step "
                                         "0: --fresh-start"):
        plan(kept, fresh_start=True)
    os.remove(kept / "checkpoints" / "latest")
    assert plan(kept, fresh_start=True).fresh_start is not None

    other = tmp_path / "other"
    commit(other, 2)
    checkpoint(other, 8, lineage="another run")  # copied in, newer
    os.remove(other / history.FILE)
    id_2, id_8 = newest_id(other, 2), newest_id(other, 8)
    with pytest.raises(ValueError, match=f"--resume-from step2 --giving-up {id_2} \\(lineage "
                                         f"mine\\) or --resume-from step8 --giving-up {id_8} "
                                         "\\(lineage another run\\)"):
        plan(other)
    with pytest.raises(ValueError, match="history.jsonl is not there"):
        plan(other, "step2", giving_up=id_8)  # not the newest of step2's run
    assert plan(other, "step2", giving_up=id_2).lineage == "mine"  # step8 is set aside
    assert plan(other, "step8", giving_up=id_8).lineage == "another run"


def test_another_runs_history_over_the_checkpoints_names_moving_it_aside(tmp_path):
    """A history copied from another run (or checkpoints replaced by another run's): every flag
    is refused, nothing moved, naming what proceeds: the history moved aside, after which the
    lost-history refusal's command does."""
    out, other = tmp_path / "run", tmp_path / "other"
    for step in (2, 4, 6):
        checkpoint(out, step, lineage="theirs")
    commit(other, 2), commit(other, 4)
    shutil.copy(other / history.FILE, out / history.FILE)
    before = everything_in(out)
    for flags in ({}, {"fresh_start": True}, {"resume_from": "step6"},
                  {"fresh_start": True, "giving_up": newest_id(other, 4)}):
        with pytest.raises(ValueError, match=f"^{out}/history.jsonl is the history of run mine, "
                           f"and {out}/checkpoints holds only another run's checkpoints \\(step2, "
                           "step4, step6, lineage theirs\\).* move this history aside \\(mv "):
            plan(out, **flags)
    assert everything_in(out) == before
    os.replace(out / history.FILE, out / "history.jsonl.other")  # as it says
    with pytest.raises(ValueError, match=f"--resume-from step6 --giving-up {newest_id(out, 6)}"):
        plan(out)
    assert plan(out, "step6", giving_up=newest_id(out, 6)).candidates == (6,)


def test_check_only_names_the_checkpoint_a_new_run_starts_from(tmp_path):
    init = types.SimpleNamespace(step_dir="/runs/a/checkpoints/step4", step=4, branch=True,
                                 with_optimizer=True)
    assert resume.what_is_where(str(tmp_path), None, init)[-1] == (
        "a run would branch from /runs/a/checkpoints/step4 at step 4 once its files verify")
    weights = types.SimpleNamespace(**{**vars(init), "branch": False, "with_optimizer": False})
    assert resume.what_is_where(str(tmp_path), None, weights)[-1] == (
        "a run would start from step 0 with the weights of /runs/a/checkpoints/step4 once its "
        "files verify")


def test_a_checkpoint_without_training_settings_names_the_version_to_resume_it_with(tmp_path):
    from tupe_ds.train.checkpoint import same_run
    step_dir = checkpoint(tmp_path / "run", 2)
    with pytest.raises(ValueError, match="step2 records no training settings: a checkpoint of a "
                                         "tupe_ds before 2026-11-29. Resume it with that version, "
                                         "or start a new run from its weights: --out NEW "
                                         "--init-from"):
        same_run.training_changes(str(step_dir), {"optimizer": None}, allow=True)


def test_with_the_history_moved_aside_the_settings_come_from_the_newest_manifest(tmp_path,
                                                                                 capsys):
    """With the history moved aside (what a damaged history's refusal says to do), the command
    that refusal then names works without the run's flags: its settings are the newest
    checkpoint's; a run.json of an earlier tupe_ds that alone holds settings is named, not
    read."""
    from tupe_ds.train.run_folder import recorded_settings
    out = tmp_path / "run"
    for step, steps in ((2, 6), (4, 8)):
        step_dir = checkpoint(out, step)
        record = manifest.read(str(step_dir))
        manifest.write(str(step_dir), {**record, "settings": {"steps": steps, "resume": "auto"}})
    args = types.SimpleNamespace(out=str(out))
    assert recorded_settings.of_run_folder(args) == (
        f"{out}/checkpoints/step4/manifest.json", {"steps": 8})
    history.append(str(out), [], [history.record("attempt", lineage="mine",
                                                 settings={"steps": 10})])
    assert recorded_settings.of_run_folder(args) == (f"{out}/history.jsonl", {"steps": 10})
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "run.json").write_text(json.dumps(
        {"objective": "mlm", "data": "d", "tp": 1, "pp": 1, "models": [{}], "settings": {}}))
    assert recorded_settings.of_run_folder(types.SimpleNamespace(out=str(earlier))) is None
    assert "run.json holds the settings of a run of a tupe_ds before 2026-11-29, which this one " \
        "does not read: give the run's flags" in capsys.readouterr().err


def test_a_folder_of_an_earlier_tupe_ds_is_refused_naming_its_folders(tmp_path):
    """No history, step folders without a manifest, `latest` naming the newest (as earlier
    versions left them): refused, each named with what to do, nothing moved."""
    out = tmp_path / "run"
    for step in (2, 4):
        (out / "checkpoints" / f"step{step}").mkdir(parents=True)
        (out / "checkpoints" / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (out / "checkpoints" / "latest").write_text("step4")
    before = everything_in(out)
    with pytest.raises(ValueError, match="history.jsonl is not there \\(or empty\\), and .* "
                                         "holds latest; step2 \\(no manifest.json\\); step4 \\(no "
                                         "manifest.json\\): .*--fresh-start .*a "
                                         "tupe_ds before 2026-11-29, which wrote no manifest, "
                                         "resume with that version"):
        plan(out)
    assert everything_in(out) == before


def test_an_older_copy_of_the_history_put_back_does_not_send_the_run_back(tmp_path):
    """A history put back from a copy made before the newest checkpoint, which is lost too:
    `latest` names it, the history never records it: refused, nothing moved; removing `latest`
    is the deliberate way on. A folder holding nothing of a run (a stray file) is a new run's."""
    out = tmp_path / "run"
    commit(out, 2), commit(out, 4)
    copy = (out / history.FILE).read_bytes()
    commit(out, 6)
    (out / "checkpoints" / "latest").write_text("step6")  # as the save of step6 writes it
    shutil.rmtree(out / "checkpoints" / "step6")
    (out / history.FILE).write_bytes(copy)
    before = everything_in(out)
    with pytest.raises(ValueError, match="records no checkpoint after step4, but .*/latest names "
                                         "step6, which the folder does not hold: is the history "
                                         "an older copy, put back\\?"):
        plan(out)
    assert everything_in(out) == before
    os.remove(out / "checkpoints" / "latest")
    assert plan(out).candidates == (4, 2)

    new = tmp_path / "new"
    (new / "checkpoints").mkdir(parents=True)
    (new / "checkpoints" / ".keep").touch()
    assert plan(new) is None


def test_an_older_copy_that_knows_none_of_the_newer_checkpoints_is_refused(tmp_path,
                                                                            deepspeed_group):
    """A copy made before a --resume-from step2 went back and the run saved a new step4 and
    step6: the script's --resume-from step2 would apply again, setting those aside unsaid. Two
    complete checkpoints of the run that the history never recorded (a commit cut short leaves
    one): refused, whatever the flags, nothing moved."""
    out = tmp_path / "run"
    for step in (2, 4, 6):
        commit(out, step)
    copy = (out / history.FILE).read_bytes()
    assert choose(out, resume_from="step2")[0].candidates == (2,)
    commit(out, 4), commit(out, 6)
    (out / history.FILE).write_bytes(copy)
    before = everything_in(out)
    for flags in ({}, {"resume_from": "step2"}):
        with pytest.raises(ValueError, match="the folder holds step4, step6 of this run, "
                                             "complete, which its history .* never recorded .*"
                                             "is it an older copy, put back\\?"):
            plan(out, **flags)
    assert everything_in(out) == before
