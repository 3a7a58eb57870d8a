"""stepN/manifest.json: the commit mark of a checkpoint and what it is checked against.

    {"format": 1, "tag": "step8", "step": 8, "lineage": "...", "identity": {...},
     "layout": {...}, "training": {...}, "files": {"NAME": {"size": BYTES, "xxh3_128": HEX}, ...},
     "software": {"torch": VERSION, "deepspeed": ..., "megatron-core": ..., "tupe_ds": ...},
     "manifest_xxh3_128": HEX}

The software that wrote it tells a file this software cannot load (a class renamed by an
upgrade) from a damaged one (`check_files`).

The manifest checksums its own content too, so that a flipped bit in it (the identity, a
file's size) makes the checkpoint damaged, not another run's.

Each rank checksums the files it wrote (the reads are spread over all ranks, as the writes
are); rank 0 writes the manifest atomically once every rank's files are there. xxh3-128 (the
xxhash package) checksums warm files at about 5 GB/s on one core of the 2-core CPU machine,
where sha256 does 1.3 and torch.save writes 0.8 (bench/checkpoint_checksum.py, 2026-11-25). It
guards against truncation, torn writes and bit flips, not against someone who rewrites the
manifest: for files from elsewhere, `safe_load.py` is the guard.
"""

import hashlib
import json
import os
from typing import Dict, List, Optional

import xxhash

from tupe_ds.tools.files import NotRegularFile, regular_file, write_atomically
from tupe_ds.train.checkpoint import reads, safe_load

MANIFEST = "manifest.json"
FORMAT = 1
SELF = "manifest_xxh3_128"  # the checksum of the manifest's own content (earlier ones have none)
CHUNK = 1 << 24


def checksum(path: str) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def describe(folder: str, names: List[str]) -> Dict[str, dict]:
    """{name: {size, xxh3_128}} of files in `folder`."""
    entries = {}
    for name in names:
        path = os.path.join(folder, name)
        entries[name] = {"size": os.path.getsize(path), "xxh3_128": checksum(path)}
    return entries


def exists(folder: str) -> bool:
    """Whether the folder's manifest is there (an error other than its absence is retried, then
    Unreadable: a manifest hidden by EIO would make its checkpoint look incomplete)."""
    return reads.exists(os.path.join(folder, MANIFEST))


def read(folder: str) -> dict:
    """The manifest of `folder`, checked field by field; ValueError naming the file and what is
    wrong when it is not a manifest tupe-pretrain wrote for this folder; reads.Unreadable when
    the filesystem does not answer for the retry window."""
    path = os.path.join(folder, MANIFEST)
    try:
        record = json.loads(reads.read_bytes(path, root=folder).decode("utf-8"))
    except (FileNotFoundError, NotRegularFile, UnicodeDecodeError, ValueError,
            RecursionError) as error:
        raise ValueError(f"{path}: not readable as a manifest ({error})") from None
    problem = record_problem(record, os.path.basename(os.path.normpath(folder)))
    if not problem and SELF in record and record[SELF] != content_checksum(record):
        problem = ("its checksum differs from its content (the file changed after it was "
                   "written)")
    if problem:
        raise ValueError(f"{path}: not a manifest tupe-pretrain wrote (format {FORMAT}): "
                         f"{problem}")
    return record


def record_problem(record, tag: str):
    """What makes `record` no manifest of checkpoint `tag` (None: it is one)."""
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
    if "training" in record and not isinstance(record["training"], dict):
        return "training is not an object"
    software = record.get("software", {})
    if not isinstance(software, dict) or not all(isinstance(v, str) for v in software.values()):
        return "software is not a name and version per package"
    return None


def digest(folder: str) -> str:
    """sha256 of the manifest's bytes: names this checkpoint's content (a conversion records
    the digest of the checkpoint it came from)."""
    return hashlib.sha256(reads.read_bytes(os.path.join(folder, MANIFEST), root=folder)
                          ).hexdigest()


def write(folder: str, record: dict) -> None:
    record = {key: value for key, value in record.items() if key not in ("format", SELF)}
    record = {"format": FORMAT, **record}
    write_atomically(os.path.join(folder, MANIFEST),
                     json.dumps({**record, SELF: content_checksum(record)}, indent=1,
                                sort_keys=True))


def content_checksum(record: dict) -> str:
    """xxh3-128 of the record's canonical JSON, without SELF: what the manifest says of itself
    (the JSON read back gives the same text: floats, ints and strings round-trip)."""
    body = {key: value for key, value in record.items() if key != SELF}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode())


NOT_PICKLED = (".json",)  # files of a checkpoint tupe_ds reads as text; every other is a pickle


def check_files(folder: str, files: Dict[str, dict],
                software: Optional[Dict[str, str]] = None) -> List[str]:
    """What is wrong with `files` (manifest entries) in `folder`: one line per file that is
    missing, no regular file, of another size, of another checksum, or holding a pickle that is
    not only tensors and the types tupe_ds's checkpoints hold. Reads that fail are retried
    (reads.Unreadable after the window), and so is a file not there before it counts as
    missing; a pickle naming a type this software does not load, in a file the manifest agrees
    with, written by other `software` (the manifest's) than the installed:
    safe_load.OtherSoftware, since it is no damage."""
    problems, waited = [], False
    for name, expected in sorted(files.items()):
        path = os.path.join(folder, name)
        try:  # one window per check: a folder whose files are gone is not waited for per file
            problem = reads.retried(path, lambda: file_problem(path, name, expected, software),
                                    expected=not waited)
        except FileNotFoundError:
            problem, waited = f"{path}: missing", True
        except NotRegularFile as error:
            problem = str(error)
        if problem:
            problems.append(problem)
    return problems


def file_problem(path: str, name: str, expected: dict,
                 software: Optional[Dict[str, str]]) -> Optional[str]:
    """check_files for one file (None: it is as the manifest says)."""
    size = os.path.getsize(regular_file(path, os.path.dirname(path)))
    if size != expected["size"]:
        return (f"{path}: {size} bytes where the manifest says {expected['size']} (truncated or "
                "rewritten)")
    if checksum(path) != expected["xxh3_128"]:
        return (f"{path}: its checksum differs from the manifest's (the file changed after it "
                "was written)")
    if name.endswith(NOT_PICKLED):
        return None
    problem, named = safe_load.inspect(path)
    if named and software and safe_load.other_versions(software):
        raise safe_load.OtherSoftware(path, named, software)
    return problem


def unlisted(folder: str, files: Dict[str, dict]) -> List[str]:
    """One line per entry of `folder` its manifest does not list: a checkpoint holds exactly
    what its save wrote, so that nothing of unknown origin is ever loaded from it."""
    extra = sorted(set(reads.list_folder(folder)) - set(files) - {MANIFEST})
    return [f"{os.path.join(folder, name)}: not listed in its manifest (not written by the "
            "checkpoint's save)" for name in extra]
