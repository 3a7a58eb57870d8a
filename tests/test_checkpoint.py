"""Which checkpoint a run resumes from: only complete ones (`latest` is written after all ranks)."""

import os

from tupe_ds.train import checkpoint


def test_saves_newer_than_latest_are_incomplete_and_removed(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"step{step}").mkdir()
        (tmp_path / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("step4")  # the save of step 6 was cut short
    checkpoint.remove_incomplete(str(tmp_path))
    assert checkpoint.saved_steps(str(tmp_path)) == [2, 4]
    assert checkpoint.latest_tag(str(tmp_path)) == "step4"


def test_without_latest_nothing_is_complete(tmp_path):
    (tmp_path / "step2").mkdir()  # the very first save was cut short
    checkpoint.remove_incomplete(str(tmp_path))
    assert checkpoint.saved_steps(str(tmp_path)) == []
    assert checkpoint.latest_tag(str(tmp_path)) is None
    assert not os.path.exists(tmp_path / "latest")
