"""The checkpoint folder's rules on made-up folders (the real runs: test_run_integrity.py):
completeness is the manifest's, retention removes only this lineage's older checkpoints, what is
in the way is set aside; and the configs the non-finite guard refuses (its counting, on real
engines: test_nonfinite.py)."""

import os

from tupe_ds.train import nonfinite
from tupe_ds.train.checkpoint import folder, manifest, same_run


LAYOUT = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "zero_stage": 2, "micro_batch": 8,
          "gradient_accumulation": 1, "vocab_size": 1024}


def checkpoint(directory, step, lineage="mine"):
    step_dir = directory / f"step{step}"
    step_dir.mkdir(parents=True)
    (step_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * step)
    if lineage is not None:
        files = manifest.describe(str(step_dir), ["mp_rank_00_model_states.pt"])
        manifest.write(str(step_dir), {"tag": f"step{step}", "step": step, "lineage": lineage,
                                       "files": files, "identity": {}, "layout": LAYOUT})


def test_completeness_is_the_manifests_not_latest(tmp_path):
    checkpoint(tmp_path, 4)
    checkpoint(tmp_path, 6)
    checkpoint(tmp_path, 8, lineage=None)  # a save cut short
    assert folder.complete_steps(str(tmp_path)) == [4, 6]
    assert folder.latest_step(str(tmp_path)) == 6  # no `latest` at all
    (tmp_path / "latest").write_text("step4")
    assert folder.latest_step(str(tmp_path)) == 6


def test_retention_removes_only_this_lineages_older_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint(tmp_path, step)
    checkpoint(tmp_path, 3, lineage="another run")
    checkpoint(tmp_path, 10, lineage="another run")
    checkpoint(tmp_path, 5, lineage=None)
    (tmp_path / ".deleting-step1").mkdir()  # a deletion a kill cut short
    assert folder.retire(str(tmp_path), 8, "mine", keep=2) == [2, 4]
    assert folder.step_folders(str(tmp_path)) == [3, 5, 6, 8, 10]
    assert not (tmp_path / ".deleting-step1").exists()
    assert folder.retire(str(tmp_path), 8, "mine", keep=1) == [6]
    assert folder.retire(str(tmp_path), 8, "mine", keep=1) == []  # never the one just written


def test_folders_in_the_way_are_set_aside_not_deleted(tmp_path):
    checkpoint(tmp_path, 2)
    checkpoint(tmp_path, 4, lineage=None)
    said = folder.set_aside(str(tmp_path), [4, 6], "in the way")
    assert said.startswith("tupe-pretrain: step4 (in the way) moved to")
    assert "nothing was deleted" in said
    moved = [os.path.join(root, d) for root, dirs, _ in os.walk(tmp_path / "set-aside")
             for d in dirs]
    assert any(path.endswith("step4") for path in moved)
    assert folder.step_folders(str(tmp_path)) == [2]
    assert folder.set_aside(str(tmp_path), [6], "in the way") is None


def test_differences_name_each_setting():
    saved = {"seq_len": 128, "models": [{"hidden_dropout": 0.1}], "data": {"train": "a"}}
    now = {"seq_len": 512, "models": [{"hidden_dropout": 0.1}], "data": {"train": "b"}}
    assert same_run.differences(saved, now) == [
        "the data (--data): other content than the checkpoint's (data.train)",
        "seq_len: 128 in the checkpoint, 512 now (--seq-len)"]
    assert same_run.differences(saved, saved) == []


def test_configs_that_would_apply_a_step_that_is_not_finite_are_refused():
    assert "ZeRO stage 0 in fp32" in nonfinite.config_problem({}, "fp32")
    assert nonfinite.config_problem({"zero_optimization": {"stage": 1}}, "fp32") is None
    assert nonfinite.config_problem({"bf16": {"enabled": True}}, "bf16") is None
    assert "check_grad_overflow" in nonfinite.config_problem(
        {"bf16": {"check_grad_overflow": False}}, "bf16")


def test_folders_set_aside_are_never_resumed_from_or_deleted(tmp_path):
    """Retention, the deletions it finishes and the removal of old conversions leave
    CHECKPOINTS/set-aside/ as it is, whatever its folders are named; no step is found in it."""
    from tupe_ds.train.checkpoint import reshard

    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    folder.set_aside(str(tmp_path), [2], "in the way")
    kept = next((tmp_path / folder.SET_ASIDE).iterdir())
    for name in (".deleting-step1", "universal"):
        (kept / name).mkdir()
    (kept / "universal" / "step1").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / folder.SET_ASIDE).rglob("*"))
    assert folder.retire(str(tmp_path), 6, "mine", keep=1) == [4]
    reshard.remove_conversions_before(str(tmp_path), 6)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / folder.SET_ASIDE).rglob("*")) \
        == before
    assert folder.step_folders(str(tmp_path)) == [6] and folder.latest_step(str(tmp_path)) == 6
