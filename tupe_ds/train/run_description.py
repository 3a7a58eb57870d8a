"""OUT/run.json: what a run is (its models, layout, data and lineage), written by rank 0 at every
start (atomically), read by tupe-export, tupe-compare and the next start of the same run.

It is a description for other tools, written anew at each start: where a start goes on from is
decided from the run's history (checkpoint/history.py), never from it.

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


def recorded(out: str) -> dict:
    """OUT/run.json as it is ({} when it does not read): what an earlier start recorded."""
    try:
        return read(out)
    except ValueError:
        return {}


def lineage(out: str) -> Optional[str]:
    """The lineage OUT/run.json records; None when there is none to read (no run.json, one
    written before lineages were recorded, or a damaged one: then the checkpoints decide)."""
    value = recorded(out).get("lineage")
    return value if isinstance(value, str) and value else None


def branched_from(out: str) -> Optional[str]:
    """The --init-from a decay branch (--branch) in `out` started from, as OUT/run.json
    records it; None for a run that is not one (or no readable run.json)."""
    return recorded(out).get("branched_from")


def damage(out: str) -> Optional[str]:
    """What is wrong with an existing OUT/run.json (None: none there, or a good one)."""
    if not os.path.exists(os.path.join(out, FILE)):
        return None
    try:
        read(out)
    except ValueError as error:
        return str(error)
    return None
