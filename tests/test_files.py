"""Outputs appear whole or not at all (tupe_ds/tools/files.py)."""

import pytest

from tupe_ds.tools.files import replacing_folder, write_atomically


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
