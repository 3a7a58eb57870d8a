"""stepN/manifest.json, a checkpoint's commit mark, written by rank 0 atomically, last: each file's
size and xxh3-128, the run's identity, lineage and layout, the writers' versions, its own checksum.
xxh3-128 checksums warm files at about 5 GB/s on one core, sha256 1.3, torch.save writes 0.8
(bench/checkpoint_checksum.py, 2026-11-25): against damage, not forgery (docs/reliability.md)."""

import hashlib
import json
import os
from typing import Dict, List, Optional

import torch.distributed as dist
import xxhash

from tupe_ds.tools.errors import NotRegularFile, OtherSoftware, Refused
from tupe_ds.tools.files import regular_file, write_atomically
from tupe_ds.train.checkpoint import reads, safe_load

MANIFEST, FORMAT, SELF = "manifest.json", 1, "manifest_xxh3_128"  # SELF: its own checksum
CHUNK = 1 << 24


def checksum(path: str) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def describe(folder: str, names: List[str]) -> Dict[str, dict]:
    """{name: {size, xxh3_128}} of files in `folder`."""
    return {name: {"size": os.path.getsize(os.path.join(folder, name)),
                   "xxh3_128": checksum(os.path.join(folder, name))} for name in names}


def exists(folder: str) -> bool:
    """Whether the folder's manifest is there (retried, then reads.Unreadable)."""
    return reads.exists(os.path.join(folder, MANIFEST))


def read(folder: str) -> dict:
    """The manifest of `folder`, checked field by field; ValueError naming the file when it is
    not one tupe-pretrain wrote for this folder; reads.Unreadable."""
    path = os.path.join(folder, MANIFEST)
    try:
        record = json.loads(reads.read_bytes(path, root=folder).decode("utf-8"))
    except (FileNotFoundError, NotRegularFile, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not readable as a manifest ({error})") from None
    if problem := _problem(record, os.path.basename(os.path.normpath(folder))):
        raise ValueError(f"{path}: not a manifest tupe-pretrain wrote (format {FORMAT}): "
                         f"{problem}")
    return record


def _problem(record, tag: str) -> Optional[str]:
    if not isinstance(record, dict):
        return "not a JSON object"
    if type(record.get("format")) is not int or record["format"] != FORMAT:
        return f"format {record.get('format')!r}"
    if record.get("tag") != tag or type(record.get("step")) is not int or \
            f"step{record['step']}" != tag:
        return f"it names {record.get('tag')!r} (step {record.get('step')!r}), not {tag}"
    for field, kind in (("lineage", str), ("identity", dict), ("layout", dict), ("files", dict)):
        if not isinstance(record.get(field), kind):
            return f"{field} is missing or not a {kind.__name__}"
    for name, entry in record["files"].items():
        if "/" in name or name in ("", ".", "..", MANIFEST) or not isinstance(entry, dict) \
                or type(entry.get("size")) is not int or entry["size"] < 0 \
                or not isinstance(entry.get("xxh3_128"), str):
            return f"files[{name!r}] is not a file's size and checksum"
    if not isinstance(record.get("training", {}), dict):
        return "training is not an object"
    software = record.get("software", {})
    if not isinstance(software, dict) or not all(isinstance(v, str) for v in software.values()):
        return "software is not a name and version per package"
    if SELF in record and record[SELF] != _self_checksum(record):
        return "its checksum differs from its content (the file changed after it was written)"
    return None


def _self_checksum(record: dict) -> str:
    # the JSON read back gives the same text: floats, ints and strings round-trip
    body = {key: value for key, value in record.items() if key != SELF}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode())


def digest(folder: str) -> str:
    """sha256 of the manifest's bytes: names the checkpoint's content (for a conversion)."""
    return hashlib.sha256(reads.read_bytes(os.path.join(folder, MANIFEST), folder)).hexdigest()


def write(folder: str, record: dict) -> None:
    record = {"format": FORMAT, **{k: v for k, v in record.items() if k not in ("format", SELF)}}
    write_atomically(os.path.join(folder, MANIFEST), json.dumps(
        {**record, SELF: _self_checksum(record)}, indent=1, sort_keys=True))


def check_files(folder: str, files: Dict[str, dict],
                software: Optional[Dict[str, str]] = None) -> List[str]:
    """A line per file of `files` (manifest entries) in `folder` that is missing, changed or refused
    by safe_load; reads.Unreadable; OtherSoftware when other `software` wrote it."""
    def problem(path: str, name: str, expected: dict) -> Optional[str]:
        size = os.path.getsize(regular_file(path, folder))
        if size != expected["size"]:
            return (f"{path}: {size} bytes where the manifest says {expected['size']} "
                    "(truncated or rewritten)")
        if checksum(path) != expected["xxh3_128"]:
            return (f"{path}: its checksum differs from the manifest's (the file changed after "
                    "it was written)")
        # read as text; every other file is a pickle
        return None if name.endswith(".json") else safe_load.scan(path, software)

    problems, waited = [], False
    for name, expected in sorted(files.items()):
        path = os.path.join(folder, name)
        try:  # one window per check: a folder whose files are gone is not waited for per file
            line = reads.retried(path, lambda: problem(path, name, expected), expected=not waited)
        except FileNotFoundError:
            line, waited = f"{path}: missing", True
        except NotRegularFile as error:
            line = str(error)
        problems += [line] if line else []
    return problems


def unlisted(folder: str, files: Dict[str, dict]) -> List[str]:
    """One line per entry of `folder` its manifest does not list (nothing else is loaded)."""
    extra = sorted(set(reads.list_folder(folder)) - set(files) - {MANIFEST})
    return [f"{os.path.join(folder, name)}: not listed in its manifest (not written by the "
            "checkpoint's save)" for name in extra]


def verify(step_dir: str) -> List[str]:
    """Collective: the problems of the checkpoint's files, each rank checking a share, alike on
    every rank; Refused (OtherSoftware) or reads.Unreadable on every rank alike."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def my_share():  # (problems, refusal)
        try:
            record = read(step_dir)
            mine = {n: record["files"][n] for n in sorted(record["files"])[rank::world]}
            return check_files(step_dir, mine, record.get("software")) + (
                unlisted(step_dir, record["files"]) if rank == 0 else []), None
        except OtherSoftware as error:
            return [], str(error)
        except reads.Unreadable:
            raise
        except Exception as error:  # on one rank, and the others wait in the gather below
            return [f"{step_dir}: {type(error).__name__}: {error}"], None

    every_rank = reads.gathered(my_share, f"every rank to verify its share of {step_dir}")
    if refusal := next((refusal for _, refusal in every_rank if refusal), None):
        raise Refused(refusal)
    return sorted({p for problems, _ in every_rank for p in problems})
