"""OUT/run.json: what a run is (its models, layout, data and lineage), written by rank 0 at every
start (atomically), read by tupe-export, tupe-compare and the next start of the same run.

It also records the newest checkpoint the run committed (`newest_checkpoint`: a folder that
holds none of its checkpoints then is refused, not started over) and the last --resume-from
applied with the checkpoints the run wrote since (`resume_from_record`), so that the flag, left
in a requeued job's command, applies once.

The lineage names the run: every checkpoint it writes carries it (checkpoint/manifest.py), so a
checkpoint of another run copied into OUT/checkpoints is told apart from the run's own however
its settings compare.
"""

import json
import os
from typing import Optional

from tupe_ds.tools.files import NotRegularFile, write_atomically
from tupe_ds.train.checkpoint import reads

FILE = "run.json"
FIELDS = {"objective": str, "data": str, "tp": int, "pp": int, "models": list}  # what readers use


def write(out: str, description: dict) -> None:
    write_atomically(os.path.join(out, FILE), json.dumps(description, indent=1))


def read(out: str) -> dict:
    """OUT/run.json as a dict; ValueError naming the file when it is missing or not one;
    reads.Unreadable when the filesystem does not give it for the retry window."""
    path = os.path.join(out, FILE)
    try:
        description = json.loads(reads.read_bytes(path, root=out).decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; tupe-pretrain writes it at the start of a run") \
            from None
    except (NotRegularFile, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not readable as a run description ({error})") from None
    if not isinstance(description, dict):
        raise ValueError(f"{path}: not a run description (not a JSON object)")
    for field, kind in FIELDS.items():
        value = description.get(field)
        if not isinstance(value, kind) or isinstance(value, bool) or (
                kind is list and not all(isinstance(item, dict) for item in value)):
            raise ValueError(f"{path}: not a run description tupe-pretrain wrote ({field} is "
                             f"missing or not a {kind.__name__})")
    if "lineage" in description and not (isinstance(description["lineage"], str)
                                         and description["lineage"]):
        raise ValueError(f"{path}: not a run description tupe-pretrain wrote (its lineage is not "
                         "a name)")
    return description


def lineage(out: str) -> Optional[str]:
    """The lineage OUT/run.json records; None when there is none to read (no run.json, one
    written before lineages were recorded, or a damaged one: then the checkpoints decide)."""
    try:
        value = read(out).get("lineage")
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def branched_from(out: str) -> Optional[str]:
    """The --init-from a decay branch (--branch) in `out` started from, as OUT/run.json
    records it; None for a run that is not one (or no readable run.json)."""
    try:
        return read(out).get("branched_from")
    except ValueError:
        return None


def exists_whole(out: str) -> bool:
    """Whether OUT/run.json is there and reads as a run description."""
    try:
        read(out)
    except ValueError:
        return False
    return True


def damage(out: str) -> Optional[str]:
    """What is wrong with an existing OUT/run.json (None: none there, or a good one)."""
    if not os.path.exists(os.path.join(out, FILE)):
        return None
    try:
        read(out)
    except ValueError as error:
        return str(error)
    return None


RESUME_FROM = "resume_from"  # {"step": N, "written": [steps saved since]}
NEWEST_CHECKPOINT = "newest_checkpoint"  # the step of the last checkpoint the run committed


def resume_from_record(out: str) -> Optional[dict]:
    """What OUT/run.json records of the last --resume-from applied: {"step": the step it chose,
    "written": the steps of the checkpoints the run saved since}; None when it records none (or
    there is no readable run.json)."""
    try:
        record = read(out).get(RESUME_FROM)
    except ValueError:
        return None
    if not isinstance(record, dict) or type(record.get("step")) is not int or not isinstance(
            record.get("written"), list) or not all(type(s) is int for s in record["written"]):
        return None
    return record


def newest_checkpoint(out: str) -> Optional[int]:
    """The step of the last checkpoint OUT/run.json records as committed (None: none, or no
    readable run.json)."""
    try:
        step = read(out).get(NEWEST_CHECKPOINT)
    except ValueError:
        return None
    return step if type(step) is int else None


def record_written(out: str, step: int) -> None:
    """Rank 0, once checkpoint `step` is committed: records it as the run's newest, and adds it
    to the steps written since the --resume-from that OUT/run.json records."""
    description = read(out)
    description[NEWEST_CHECKPOINT] = step
    record = resume_from_record(out)
    if record is not None:
        description[RESUME_FROM] = {**record, "written": [*record["written"], step]}
    write(out, description)
