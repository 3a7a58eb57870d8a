"""stepN/manifest.json: the commit mark of a checkpoint and what it is checked against.

    {"format": 1, "tag": "step8", "step": 8, "lineage": "...", "identity": {...},
     "layout": {...}, "files": {"NAME": {"size": BYTES, "xxh3_128": HEX}, ...}}

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
from typing import Dict, List

import xxhash

from tupe_ds.tools.files import write_atomically
from tupe_ds.train.checkpoint import safe_load

MANIFEST = "manifest.json"
FORMAT = 1
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
    return os.path.exists(os.path.join(folder, MANIFEST))


def read(folder: str) -> dict:
    """The manifest of `folder`; ValueError naming the file when it is not one."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable as a manifest ({error})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "files" not in record:
        raise ValueError(f"{path}: not a manifest tupe-pretrain wrote (format {FORMAT})")
    return record


def digest(folder: str) -> str:
    """sha256 of the manifest's bytes: names this checkpoint's content (a conversion records
    the digest of the checkpoint it came from)."""
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write(folder: str, record: dict) -> None:
    write_atomically(os.path.join(folder, MANIFEST),
                     json.dumps({"format": FORMAT, **record}, indent=1, sort_keys=True))


def check_files(folder: str, files: Dict[str, dict]) -> List[str]:
    """What is wrong with `files` (manifest entries) in `folder`: one line per file that is
    missing, of another size, of another checksum, or holding a pickle that is not only
    tensors and the types tupe_ds's checkpoints hold."""
    problems = []
    for name, expected in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(path)
        if size != expected["size"]:
            problems.append(f"{path}: {size} bytes where the manifest says {expected['size']} "
                            "(truncated or rewritten)")
        elif checksum(path) != expected["xxh3_128"]:
            problems.append(f"{path}: its checksum differs from the manifest's (the file "
                            "changed after it was written)")
        elif name.endswith(".pt"):
            problem = safe_load.scan(path)
            if problem:
                problems.append(problem)
    return problems
