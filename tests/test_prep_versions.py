"""A prepared folder records the version of the cleaning rules that made its text and keys
(data_prep/output.py, CLEANING_VERSION); --dedup-against and merge refuse folders of different
versions, naming them, their versions and what to do."""

import json
import random
import re

import pytest

from data_prep import output
from data_prep.cli import main
from data_prep.merge import merge
from data_prep.output import CLEANING_VERSION
from test_data_prep import run, unique_document, write_txt


def as_an_earlier_tupe_prep_wrote_it(folder):
    """The folder's manifest without its cleaning version, as tupe-prep wrote it before."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["cleaning_version"]
    path.write_text(json.dumps(manifest))


@pytest.fixture
def folders(tmp_path):
    """Two folders of an earlier tupe-prep ("old0", "old1") and one of this one ("new"), of one
    tokenizer, each of a few documents of its own."""
    rng = random.Random(3)
    tokenizer = None
    for name in ("old0", "old1", "new"):
        source = write_txt(tmp_path / f"{name}.txt", [unique_document(rng) for _ in range(4)])
        manifest = run([source], tmp_path / name, tokenizer=tokenizer)
        assert manifest["cleaning_version"] == CLEANING_VERSION
        tokenizer = str(tmp_path / "old0" / "tokenizer.json")
    for name in ("old0", "old1"):
        as_an_earlier_tupe_prep_wrote_it(tmp_path / name)
    return tmp_path


def test_dedup_against_a_folder_of_another_version_is_refused(folders, capsys):
    source = write_txt(folders / "more.txt", [unique_document(random.Random(4))])
    argv = ["--input", source, "--out", str(folders / "more"), "--quiet", "--workers", "1",
            "--tokenizer", str(folders / "old0" / "tokenizer.json"), "--dedup-against"]
    assert main(argv + [str(folders / "new"), str(folders / "old1")]) == 2
    said = capsys.readouterr().err
    assert ("--dedup-against: the folders' texts were cleaned and keyed by different rules"
            in said)
    assert f"{folders / 'more'} (this run) version {CLEANING_VERSION}" in said
    assert f"{folders / 'old1'} version 1 (the rules before versions were recorded)" in said
    assert f"Prepare {folders / 'old1'} again from its input with this tupe-prep" in said
    assert not (folders / "more").exists()  # refused before anything was read or written
    assert main(argv + [str(folders / "new")]) == 0
    again = argv[:argv.index("--out") + 1] + [str(folders / "new")] + argv[argv.index("--out") + 2:]
    assert main(again + [str(folders / "new")]) == 2  # the folder it writes
    assert f"--dedup-against: {folders / 'new'} is this run's --out" in capsys.readouterr().err


def test_merge_refuses_folders_of_different_versions(folders):
    with pytest.raises(ValueError, match=rf"merge: .* {folders / 'old0'} version 1 .*, "
                                         rf"{folders / 'new'} version {CLEANING_VERSION}\. "
                                         rf"Prepare {folders / 'old0'} again"):
        merge([str(folders / "old0"), str(folders / "new")], str(folders / "mixed"), quiet=True)
    assert not (folders / "mixed").exists()
    # folders of one earlier version merge together, and the merge keeps their version
    old = merge([str(folders / "old0"), str(folders / "old1")], str(folders / "old"), quiet=True)
    assert old["cleaning_version"] == 1 and old["documents_out"] == 8
    with pytest.raises(ValueError, match=rf"{folders / 'old'} version 1"):
        merge([str(folders / "new")], str(folders / "against"), quiet=True,
              dedup_against=[str(folders / "old")])
    new = merge([str(folders / "new")], str(folders / "new-merged"), quiet=True)
    assert new["cleaning_version"] == CLEANING_VERSION


@pytest.mark.parametrize("value", ['"2"', "true", "[2]", "0", "null"])
def test_a_cleaning_version_that_is_no_version_is_refused_naming_the_file(tmp_path, value):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"cleaning_version": %s}' % value)
    with pytest.raises(ValueError, match=rf"{folder}/manifest.json: cleaning_version "
                                         rf"{re.escape(value)} is no version"):
        output.cleaning_version(str(folder), output.read_manifest(str(folder)))


def test_manifests_that_do_not_read_and_newer_versions_are_refused_saying_what_to_do(tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"cleaning_version": ')
    with pytest.raises(ValueError, match=rf"{folder}/manifest.json: not readable as a tupe-prep "
                                         "manifest"):
        output.read_manifest(str(folder))
    (folder / "manifest.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        output.read_manifest(str(folder))
    newer = output.CLEANING_VERSION + 1
    with pytest.raises(ValueError, match=rf"merge: b was cleaned by the rules of version {newer}, "
                                         "newer than this tupe-prep's .*: run this with the "
                                         "tupe-prep that made it"):
        output.check_cleaning_versions({"a": output.CLEANING_VERSION, "b": newer}, "merge")
