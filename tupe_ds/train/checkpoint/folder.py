"""A run's checkpoints folder (OUT/checkpoints) on disk:

    stepN/               a checkpoint, complete when stepN/manifest.json reads
    latest               the newest checkpoint committed (DeepSpeed's pointer, not the rule)
    set-aside/UTC-TIME/  folders moved out of the way: never resumed, never deleted by tupe_ds
    .deleting-stepN      a deletion of retention in progress (the next one finishes it)
    universal/stepN      DeepSpeed universal conversions (reshard.py)"""

import os
import re
import shutil
import time
from typing import Dict, List, Optional, Tuple

from tupe_ds.tools.files import sync_folder, write_atomically
from tupe_ds.train.checkpoint import manifest, reads, reshard

TAG = re.compile(r"^step(\d+)$")
SET_ASIDE = "set-aside"
DELETING = ".deleting-"


def tag_of(step: int) -> str:
    return f"step{step}"


def tags(steps) -> str:
    return ", ".join(tag_of(s) for s in sorted(steps))


def step_of(tag: str) -> int:
    match = TAG.match(tag)
    if not match:
        raise ValueError(f"{tag!r} is not a checkpoint name; checkpoints are named stepN")
    return int(match.group(1))


def step_folders(directory: str) -> List[int]:
    """Steps of every stepN folder, complete or not, ascending (the listing retried)."""
    return sorted(int(m.group(1)) for m in map(TAG.match, reads.list_folder(directory)) if m)


def survey(directory: str) -> Tuple[Dict[int, dict], Dict[int, str]]:
    """(the manifest of each complete checkpoint, the problem of each whose manifest does not
    read), by step; reads.Unreadable when the filesystem does not give one."""
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


def complete_steps(directory: str) -> List[int]:
    return sorted(survey(directory)[0])


def latest_step(directory: str) -> int:
    """The step of the newest complete checkpoint; 0 when there is none."""
    return max(complete_steps(directory), default=0)


def point_latest(directory: str, tag: str) -> None:
    write_atomically(os.path.join(directory, "latest"), tag)


def set_aside(directory: str, steps: List[int], why: str) -> Optional[str]:
    """Rank 0: moves stepN folders into a new set-aside/UTC-TIME/; the line that says so."""
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
    return f"tupe-pretrain: {tags(steps)} ({why}) moved to {target}; nothing was deleted"


def retire(directory: str, step: int, lineage: str, keep: int,
           before=lambda manifests: None) -> List[int]:
    """Rank 0, once `step` is committed: removes the complete checkpoints of `lineage` older than
    it beyond the newest `keep` (`before` gets their manifests first), and finishes deletions a
    kill cut short. Each is renamed, durably, before it is removed: a deletion cut short never
    leaves a stepN that looks like a checkpoint. The steps removed."""
    for name in os.listdir(directory):
        if name.startswith(DELETING):
            remove_tree(os.path.join(directory, name))
    complete = survey(directory)[0]
    older = [s for s, record in sorted(complete.items())
             if s < step and record["lineage"] == lineage]
    removed = older[:max(len(older) - (keep - 1), 0)]
    before([complete[old] for old in removed])
    for old in removed:
        doomed = os.path.join(directory, DELETING + tag_of(old))
        os.replace(os.path.join(directory, tag_of(old)), doomed)
        sync_folder(directory)
        remove_tree(doomed)
    return removed


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
