"""An output folder that appears whole or not at all: a run (prepare or merge) writes its files
in OUTPUT/.tmp-prep and `publish` moves them into OUTPUT, the manifest last."""

import contextlib
import json
import os
import shutil

from tupe_ds.tools.files import fresh_folder, locked

SPLITS = ("train", "valid")  # OUTPUT/{train,valid}.{bin,idx,keys.npy} and near-duplicate files
WORK_DIR = ".tmp-prep"
LOCK = ".tupe-prep.lock"
SPOOL = "documents.jsonl"  # prepare's kept documents, from pass 1 to pass 2: not published
DEDUP_STATE = "dedup"  # prepare's de-duplicator's files (data_prep/dedup.py), likewise


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, "manifest.json")
    if not os.path.exists(path):
        raise ValueError(f"{folder}: no manifest.json, so the folder is missing or unfinished; "
                         "re-run its tupe-prep command")
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def work_folder(output: str):
    """OUTPUT/.tmp-prep, empty, for a run's files until `publish` moves them into OUTPUT; removed
    if the run fails (a killed process leaves it to the next run, which removes it first). Runs
    into one OUTPUT take turns (OUTPUT/.tupe-prep.lock): the later one waits, then replaces
    the earlier one's output."""
    os.makedirs(output, exist_ok=True)
    with locked(os.path.join(output, LOCK)), fresh_folder(os.path.join(output, WORK_DIR)) as work:
        yield work


def publish(work: str, output: str, manifest: dict) -> None:
    """Move the finished files of `work` into `output`, the manifest last, then drop `work`.

    An output folder is complete when it has a manifest.json; an older one goes first.
    """
    old_manifest = os.path.join(output, "manifest.json")
    if os.path.exists(old_manifest):
        os.remove(old_manifest)
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    names = sorted(n for n in os.listdir(work)
                   if n not in (SPOOL, DEDUP_STATE, "manifest.json"))
    for name in names + ["manifest.json"]:
        os.replace(os.path.join(work, name), os.path.join(output, name))
    shutil.rmtree(work)
