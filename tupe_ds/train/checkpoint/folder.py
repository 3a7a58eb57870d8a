"""The checkpoint folder on disk: which step folders are complete, the `latest` pointer, folders
set aside, and retention.

    CHECKPOINTS/stepN/                a checkpoint; complete when stepN/manifest.json exists
    CHECKPOINTS/latest                the tag of the newest checkpoint this run committed
                                      (DeepSpeed's and other tools' pointer; not the rule)
    CHECKPOINTS/set-aside/UTC-TIME/   folders moved out of the way, never resumed from and
                                      never deleted by tupe_ds
    CHECKPOINTS/.deleting-stepN       retention's deletion in progress (finished by the next)
    CHECKPOINTS/universal/stepN       DeepSpeed universal conversions (reshard.py)
"""

import os
import re
import shutil
import time
from typing import Dict, List, Optional, Tuple

from tupe_ds.tools.files import NotRegularFile, sync_folder, write_atomically
from tupe_ds.train.checkpoint import history, manifest, reads, reshard

TAG = re.compile(r"^step(\d+)$")
SET_ASIDE = "set-aside"
DELETING = ".deleting-"


def tag_of(step: int) -> str:
    return f"step{step}"


def step_of(tag: str) -> int:
    match = TAG.match(tag)
    if not match:
        raise ValueError(f"{tag!r} is not a checkpoint name; checkpoints are named stepN")
    return int(match.group(1))


def step_folders(directory: str) -> List[int]:
    """Steps of every stepN folder, complete or not, in ascending order (the listing retried:
    a folder EIO hides is no folder without checkpoints)."""
    return sorted(int(m.group(1)) for m in map(TAG.match, reads.list_folder(directory)) if m)


def survey(directory: str) -> Tuple[Dict[int, dict], Dict[int, str]]:
    """(complete, damaged): the manifest of each complete checkpoint, by step; and for each step
    folder whose manifest is there but does not read as one (manifest.read), the problem. A
    damaged checkpoint is never resumed, retired or a fallback: it is kept. A manifest the
    filesystem does not give is neither: reads.Unreadable."""
    complete, damaged = {}, {}
    for step in step_folders(directory):
        step_dir = os.path.join(directory, tag_of(step))
        if manifest.exists(step_dir):
            try:
                record = manifest.read(step_dir)
                reshard.saved_layout(record)
                complete[step] = record
            except ValueError as error:
                damaged[step] = str(error)
    return complete, damaged


def inventory(directory: str) -> List[str]:
    """A line per step folder of `directory` (complete, with its lineage; damaged, and why;
    incomplete) and per folder set aside: what is where, for tupe-pretrain --check-only."""
    complete, damaged = survey(directory)
    lines = []
    for step in step_folders(directory):
        path = os.path.join(directory, tag_of(step))
        lines.append(f"{path}: complete (lineage {complete[step]['lineage']})" if step in complete
                     else f"{path}: damaged ({damaged[step]})" if step in damaged
                     else f"{path}: not a folder" if not os.path.isdir(path)
                     else f"{path}: incomplete (no manifest.json: a save cut short)")
    kept = os.path.join(directory, SET_ASIDE)
    for when in sorted(reads.list_folder(kept)):
        for name in sorted(reads.list_folder(os.path.join(kept, when))):
            lines.append(f"{os.path.join(kept, when, name)}: set aside (never resumed from, "
                         "never deleted by tupe_ds)")
    return lines


def set_aside_manifests(directory: str) -> Dict[str, dict]:
    """The manifests of the complete checkpoints in CHECKPOINTS/set-aside/*/, by their id
    (history.checkpoint_id); those whose manifest does not read are not counted."""
    kept, found = os.path.join(directory, SET_ASIDE), {}
    for when in sorted(reads.list_folder(kept)):
        for name in sorted(reads.list_folder(os.path.join(kept, when))):
            if TAG.match(name) and manifest.exists(os.path.join(kept, when, name)):
                try:
                    record = manifest.read(os.path.join(kept, when, name))
                except ValueError:
                    continue
                found[history.checkpoint_id(record)] = record
    return found


def complete_steps(directory: str) -> List[int]:
    """Steps of the folders whose manifest reads, in ascending order."""
    return sorted(survey(directory)[0])


def latest_tag(directory: str) -> Optional[str]:
    """What `latest` names (None without one, or when it is not a checkpoint's name):
    informative, since completeness is the manifest's; a checkpoint of an earlier tupe_ds without
    a manifest is found through it."""
    path = os.path.join(directory, "latest")
    try:
        tag = reads.read_bytes(path, root=directory)[:256].decode("utf-8", errors="replace")
    except (FileNotFoundError, NotRegularFile):
        return None
    tag = tag.strip()
    return tag if TAG.match(tag) else None


def legacy_step(directory: str) -> Optional[int]:
    """The step of a checkpoint written before manifests existed: `latest` names a folder
    without a manifest, which earlier versions wrote only when every rank's files were there."""
    tag = latest_tag(directory)
    if tag is None:
        return None
    folder = os.path.join(directory, tag)
    with_manifest = [s for s in step_folders(directory)
                     if manifest.exists(os.path.join(directory, tag_of(s)))]
    if os.path.isdir(folder) and not with_manifest:
        return step_of(tag)
    return None


def latest_step(directory: str) -> int:
    """The step of the newest complete checkpoint in `directory`; 0 when there is none."""
    steps = complete_steps(directory)
    return steps[-1] if steps else (legacy_step(directory) or 0)


def point_latest(directory: str, tag: str) -> None:
    write_atomically(os.path.join(directory, "latest"), tag)


def set_aside(directory: str, steps: List[int], why: str) -> Optional[str]:
    """Rank 0: moves stepN folders into CHECKPOINTS/set-aside/UTC-TIME/ (kept, never deleted
    by tupe_ds) and returns the line that says so (None when there was nothing to move)."""
    steps = [s for s in steps if os.path.isdir(os.path.join(directory, tag_of(s)))]
    if not steps:
        return None
    stamp = os.path.join(directory, SET_ASIDE, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    target, again = stamp, 1
    while os.path.exists(target):  # a set-aside of the same second: a folder of its own
        again += 1
        target = f"{stamp}-{again}"
    os.makedirs(target)
    for step in steps:
        os.replace(os.path.join(directory, tag_of(step)), os.path.join(target, tag_of(step)))
    names = ", ".join(tag_of(s) for s in steps)
    return f"tupe-pretrain: {names} ({why}) moved to {target}; nothing was deleted"


def retire(directory: str, step: int, lineage: str, keep: int,
           before=lambda manifests: None) -> List[int]:
    """Rank 0, after step `step` was committed: removes the complete checkpoints of `lineage`
    older than `step` beyond the newest `keep` (the new one counts), and finishes deletions a
    kill cut short. `before` is given their manifests first (the history records them retired
    before any is touched). A folder is renamed before it is removed, so that a deletion cut
    short never leaves a stepN folder that looks like a checkpoint. Returns the steps removed."""
    finish_deletions(directory)
    complete, _ = survey(directory)
    older = [s for s, record in sorted(complete.items())
             if s < step and record["lineage"] == lineage]
    removed = older[:max(len(older) - (keep - 1), 0)]
    before([complete[old] for old in removed])
    for old in removed:
        doomed = os.path.join(directory, DELETING + tag_of(old))
        os.replace(os.path.join(directory, tag_of(old)), doomed)
        sync_folder(directory)  # on disk before any removal: never a stepN missing files
        remove_tree(doomed)
    return removed


def finish_deletions(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(DELETING):
            remove_tree(os.path.join(directory, name))


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
