"""An output folder that appears whole or not at all: a run (prepare or merge) writes its files
in a work folder of its own, OUTPUT/.tmp-prep.HOST.PID.TOKEN, and `publish` moves them into
OUTPUT, the manifest last. Its manifest records the version of the rules that made its text and
keys (CLEANING_VERSION), and folders of different versions are not de-duplicated together
(`check_cleaning_versions`)."""

import contextlib
import json
import logging
import os
import shutil

from tupe_ds.tools.files import locked, write_atomically
from tupe_ds.tools.lock import (HOLDER_SUFFIX, describe, gone_because, lock_content,
                                parse_holder, same_machine, this_holder)

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid")  # OUTPUT/{train,valid}.{bin,idx,keys.npy} and near-duplicate files
WORK_DIR = ".tmp-prep"  # a run's work folder is OUTPUT/.tmp-prep.HOST.PID.TOKEN
LOCK = ".tupe-prep.lock"
SPOOL = "documents.jsonl"  # prepare's kept documents, from pass 1 to pass 2: not published
DEDUP_STATE = "dedup"  # prepare's de-duplicator's files (data_prep/dedup.py), likewise
# The version of the rules that turn a document into a folder's text, keys and shingles: cleaning
# (data_prep/clean.py), the exact key and the shingles (dedup.py, near.py), what is dropped as
# short and the sentences (sentences.py). Bump it whenever one of them changes what a document
# becomes: --dedup-against and merge refuse folders of different versions, whose duplicates
# would not meet. Manifests written before it was recorded have none: version 1.
CLEANING_VERSION = 2


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, "manifest.json")
    if not os.path.exists(path):
        raise ValueError(f"{folder}: no manifest.json, so the folder is missing or unfinished; "
                         "re-run its tupe-prep command")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: not readable as a tupe-prep manifest ({error}); re-run its "
                         "tupe-prep command") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: not a tupe-prep manifest (not a JSON object); re-run its "
                         "tupe-prep command")
    return manifest


def cleaning_version(folder: str, manifest: dict) -> int:
    """The cleaning_version of `folder`'s manifest, 1 where it has none (a tupe-prep before
    they were recorded); ValueError naming the file where it is no version."""
    version = manifest.get("cleaning_version", 1)
    if type(version) is not int or version < 1:
        raise ValueError(f"{os.path.join(folder, 'manifest.json')}: cleaning_version "
                         f"{json.dumps(version)} is no version of tupe-prep's cleaning rules (a "
                         "whole number from 1); re-run its tupe-prep command")
    return version


def check_cleaning_versions(versions: dict, command: str) -> int:
    """The one cleaning version of `versions` (folder -> the version its text and keys were made
    with); a ValueError naming the folders and their versions when they differ, saying to
    prepare again those not of this tupe-prep's CLEANING_VERSION. Keys recomputed from a folder
    would not do: it holds the text as its own version cleaned it, not the input."""
    newer = {folder: version for folder, version in versions.items()
             if version > CLEANING_VERSION}
    if newer:
        made = ", ".join(f"{folder} was cleaned by the rules of version {version}"
                         for folder, version in newer.items())
        raise ValueError(f"{command}: {made}, newer than this tupe-prep's ({CLEANING_VERSION}): "
                         "run this with the tupe-prep that made it")
    found = set(versions.values())
    if len(found) == 1:
        return found.pop()
    described = ", ".join(
        f"{folder} version {version}" + (" (the rules before versions were recorded)"
                                         if version == 1 else "")
        for folder, version in versions.items())
    stale = [folder for folder, version in versions.items() if version != CLEANING_VERSION]
    raise ValueError(f"{command}: the folders' texts were cleaned and keyed by different rules, "
                     f"so their duplicates would not be found: {described}. Prepare "
                     f"{', '.join(stale)} again from {'its' if len(stale) == 1 else 'their'} "
                     f"input with this tupe-prep (cleaning version {CLEANING_VERSION}), then run "
                     "this again")


@contextlib.contextmanager
def work_folder(output: str):
    """An empty folder of this run's own, OUTPUT/.tmp-prep.HOST.PID.TOKEN, for its files until
    `publish` moves them into OUTPUT; removed when the block ends, published or failed. Beside
    it, FOLDER.holder records its run (tupe_ds/tools/lock.py), so that a later run can
    remove what a killed one left (`remove_abandoned_work`). Runs into one OUTPUT take turns
    (OUTPUT/.tupe-prep.lock): the later one waits, then replaces the earlier one's output; where
    the lock holds on one node only (Lustre's localflock, NFS with local locks), runs on two
    nodes still never touch each other's work."""
    os.makedirs(output, exist_ok=True)
    with locked(os.path.join(output, LOCK)):
        remove_abandoned_work(output)
        holder = this_holder()
        work = os.path.join(output, f"{WORK_DIR}.{holder['host']}.{holder['pid']}."
                                    f"{holder['token'][:8]}")
        write_atomically(work + HOLDER_SUFFIX, json.dumps(holder, indent=1))  # before the folder
        try:
            os.makedirs(work)
            yield work
        finally:
            remove_work(work)


def remove_work(work: str) -> None:
    """The work folder, then its record: a removal cut short leaves the record, so that a later
    run can judge what remains."""
    shutil.rmtree(work, ignore_errors=True)
    if not os.path.exists(work):
        with contextlib.suppress(FileNotFoundError):  # removed by another node's run meanwhile
            os.remove(work + HOLDER_SUFFIX)


def remove_abandoned_work(output: str) -> None:
    """Removes the work folders in `output` whose run is gone by the rules of the lock files'
    holders (tupe_ds/tools/lock.py: its process of this machine has ended, it is this
    Slurm job before a requeue, or its record is damaged), saying so; says which it leaves and
    why. A run on another machine is never judged gone by age: its record is not renewed, as a
    run may take hours, so only the requeue rule can find it gone."""
    for name in sorted(os.listdir(output)):
        folder = os.path.join(output, name)
        if not (name == WORK_DIR or name.startswith(WORK_DIR + ".")):
            continue
        if name.endswith(HOLDER_SUFFIX):
            judge_work(folder[:-len(HOLDER_SUFFIX)])
        elif os.path.isdir(folder) and not os.path.exists(folder + HOLDER_SUFFIX):
            logger.info(f"tupe-prep: left {folder}: no record of the run that wrote it beside it "
                        "(an earlier version's work folder?); remove it once no tupe-prep run "
                        "writes it")


def judge_work(folder: str) -> None:
    """Removes the work folder `folder` if its run is gone, saying so; else says it is left."""
    record = lock_content(folder + HOLDER_SUFFIX)
    if record is None:
        return  # its run finished meanwhile
    holder = parse_holder(record)
    run = f"the work folder of {describe(holder)}" if holder else "a work folder"
    why = gone_because(holder, lease_age=0.0)
    if why:
        remove_work(folder)
        logger.info(f"tupe-prep: removed {folder}, {run}: {why}")
    else:
        where = ("a live process of this machine" if same_machine(holder) else
                 "which may still be running on another machine; remove it once that process "
                 "has ended")
        logger.info(f"tupe-prep: left {folder}, {run}, {where}")


def publish(work: str, output: str, manifest: dict) -> None:
    """Move the finished files of `work` into `output`, the manifest last.

    An output folder is complete when it has a manifest.json; an older one goes first.
    """
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(output, "manifest.json"))
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    names = sorted(n for n in os.listdir(work)
                   if n not in (SPOOL, DEDUP_STATE, "manifest.json"))
    for name in names + ["manifest.json"]:
        os.replace(os.path.join(work, name), os.path.join(output, name))
