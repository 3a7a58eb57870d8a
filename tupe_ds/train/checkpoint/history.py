"""OUT/history.jsonl, a run's one history, and the decision every start makes from it and the
folder's listing (`decide`, pure; tests/test_history.py runs it through random histories).

One record per line, numbered, checksummed and fsynced: attempt, committed (a checkpoint's own
id, step, lineage, files), set_aside, retired, consent (--resume-from or --fresh-start, spent on
the state it was given on). The rules are told in docs/reliability.md."""

import collections
import dataclasses
import json
import os
import socket
import time
import uuid
from typing import Dict, List, Optional, Tuple

import xxhash

from tupe_ds.tools.errors import HistoryDamaged, NotRegularFile
from tupe_ds.tools.files import sync_folder
from tupe_ds.train.checkpoint import reads
from tupe_ds.train.checkpoint.folder import tag_of, tags

FILE = "history.jsonl"
KINDS = ("attempt", "committed", "set_aside", "retired", "consent")


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def checkpoint_id(manifest: dict) -> str:
    """A checkpoint's id: its manifest's (before ids, the manifest's checksum of itself)."""
    return str(manifest.get("id") or manifest.get("manifest_xxh3_128", "")[:16]
               or f"{manifest.get('lineage')}-{manifest.get('step')}")


def checksum(record: dict) -> str:
    body = {key: value for key, value in record.items() if key != "xxh3_64"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def read(out: str) -> Optional[List[dict]]:
    """The records of OUT/history.jsonl, oldest first (None: no history); HistoryDamaged;
    reads.Unreadable when the filesystem does not give it."""
    path = os.path.join(out, FILE)
    try:
        return parsed(reads.read_bytes(path, root=out), path)[0]
    except FileNotFoundError:
        return None
    except NotRegularFile as error:
        raise HistoryDamaged(str(error)) from None


def parsed(data: bytes, path: str) -> Tuple[List[dict], int]:
    """(the records, the length of the bytes that hold them): a last line that is no record (a
    kill cut its append short, or a crash its sync) is not one of them."""
    lines = data.split(b"\n")
    torn = lines.pop()  # after the last newline: b"" unless a kill cut an append short
    records, length = [], 0
    for number, line in enumerate(lines, start=1):
        try:
            item = json.loads(line)
            problem = ("not a record of a run's history" if not isinstance(item, dict)
                       or item.get("kind") not in KINDS else
                       "its checksum differs from its content" if item.get("xxh3_64")
                       != checksum(item) else f"numbered {item.get('seq')!r}, not {number}"
                       if item.get("seq") != number else None)
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            problem = f"not JSON ({error})"
        if problem and number == len(lines) and not torn:
            break
        if problem:
            raise HistoryDamaged(
                f"{path}, line {number}: {problem}. The history is never guessed around: move "
                f"the file aside (mv {path} {path}.damaged) and run the same command, which "
                "then says how to go on from the checkpoints the folder holds")
        records.append(item)
        length += len(line) + 1
    return records, length


def record(kind: str, **fields) -> dict:
    return {"kind": kind, "time": time.time(), **fields}


def append(out: str, records: List[dict], new: List[dict]) -> None:
    """Appends `new` (made by `record`) to OUT/history.jsonl and to `records` (the history as
    read), numbered, checksummed and durable (the file, and its folder when new); what a kill
    left after the last record is cut off first."""
    if not new:
        return
    for item in new:
        numbered = {**item, "seq": len(records) + 1}
        records.append({**numbered, "xxh3_64": checksum(numbered)})
    path = os.path.join(out, FILE)
    created = not os.path.exists(path)
    with open(path, "ab") as f:
        if f.tell():
            with open(path, "rb") as existing:
                f.truncate(parsed(existing.read(), path)[1])
        f.write(b"".join(json.dumps(r, sort_keys=True).encode() + b"\n"
                         for r in records[-len(new):]))
        f.flush()
        os.fsync(f.fileno())
    if created:
        sync_folder(out)


Checkpoint = collections.namedtuple("Checkpoint", "id step lineage")
# a stepN folder: its manifest's id and lineage when it reads (complete), else None
Folder = collections.namedtuple("Folder", "step id lineage", defaults=(None, None))
Flags = collections.namedtuple("Flags", "resume_from fresh_start giving_up",
                               defaults=(None, False, None))


def live(records: List[dict]) -> List[Checkpoint]:
    """The checkpoints committed and neither set aside, retired nor given up, in commit order."""
    gone = set()
    for item in records:
        if item["kind"] in ("set_aside", "retired"):
            gone.add(item.get("id"))
        elif item["kind"] == "consent" and item["outcome"] == "applied":
            gone.update(item["gives_up"])
    return [Checkpoint(r["id"], r["step"], r["lineage"]) for r in records
            if r["kind"] == "committed" and r["id"] not in gone]


def lineage(records: List[dict]) -> Optional[str]:
    """The run's: its last start's, else (a history whose start was cut off) its commits'."""
    return next((r["lineage"] for kind in ("attempt", "committed") for r in reversed(records)
                 if r["kind"] == kind), None)


def recorded_settings(records: List[dict]) -> Optional[dict]:
    """The settings of the last attempt."""
    return next((r["settings"] for r in reversed(records)
                 if r["kind"] == "attempt" and isinstance(r.get("settings"), dict)), None)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The steps to try, newest first (the rest are fallbacks), or a refusal; the records to
    append first (adoptions, the consent spent); lines to say."""
    candidates: Tuple[int, ...] = ()
    refusal: Optional[str] = None
    appends: Tuple[dict, ...] = ()
    notes: Tuple[str, ...] = ()
    by_hand: bool = False  # --resume-from: that checkpoint or a refusal
    fresh_start: Optional[dict] = None  # the --fresh-start consent, spent if none verifies


def decide(records: List[dict], folders: Tuple[Folder, ...], flags: Flags,
           run_lineage: str) -> Decision:
    """Where a start goes on from (pure): never older than the newest intact checkpoint of the
    history unless a consent spent now names that state; a live checkpoint the folder lacks
    refuses; nothing is given up without consent."""
    complete = {f.step: f for f in folders if f.id is not None}
    committed = {(r["id"], r["step"]) for r in records if r["kind"] == "committed"}
    # a commit cut short before its record is adopted (a copy under another step is another)
    appends = [record("committed", id=f.id, step=f.step, lineage=f.lineage, adopted=True)
               for f in complete.values() if f.lineage == run_lineage
               and (f.id, f.step) not in committed]
    if records and len(appends) > 1:  # a commit cut short leaves one; an older copy, several
        return Decision(refusal=(
            f"the folder holds {tags(a['step'] for a in appends)} of this run, complete, which "
            f"its history ({FILE}) never recorded (id {', '.join(a['id'] for a in appends)}): "
            "is it an older copy, put back? Nothing was moved or deleted. Put back the history "
            "as it was last written and run the same command; or move it aside (mv "
            f"{FILE} {FILE}.old) and run the same command, which then names the command that "
            "goes on from the newest checkpoint"))
    # by step: adopted checkpoints are recorded after those committed since
    state = sorted(live([*records, *appends]), key=lambda c: c.step)
    consent, notes, refusal = consent_of(records, flags, state, complete)
    if refusal:
        return Decision(refusal=refusal)
    applied = consent is not None and consent["outcome"] == "applied"
    if applied and consent["target"]:  # --resume-from
        return Decision((next(c.step for c in state if c.id == consent["target"]),),
                        appends=(*appends, consent), notes=notes, by_hand=True)
    kept = [c for c in state if not (applied and c.id in consent["gives_up"])]
    on_disk = {c.id for c in kept if complete.get(c.step) and complete[c.step].id == c.id}
    # set aside by hand is no consent: only the history's records take a checkpoint out
    lost = [c for c in kept if c.id not in on_disk
            and not any(f.step == c.step and f.id is None for f in folders)]
    resumable = [c.step for c in reversed(kept) if c.id in on_disk]
    if lost and (lost[-1].step > resumable[0] if resumable else consent is None):
        on = (f"go on from {tag_of(resumable[0])} deliberately, giving up "
              f"{tags(c.step for c in kept if c.step > resumable[0])}: --resume-from "
              f"{tag_of(resumable[0])} --giving-up {kept[-1].id}" if resumable else
              f"start over from step 0: --fresh-start --giving-up {kept[-1].id}")
        return Decision(refusal=(
            f"the run's history records {tags(c.step for c in lost)} as committed (id "
            f"{', '.join(c.id for c in lost)}), but the folder holds none of it (was it moved or "
            "lost? a folder set aside by hand is not given up). Nothing was moved or deleted. "
            f"Put it back and run the same command; or {on}"), notes=notes)
    return Decision(tuple(resumable), appends=tuple(appends), notes=notes, fresh_start=consent)


def consent_of(records: List[dict], flags: Flags, state: List[Checkpoint],
               complete: Dict[int, Folder]) -> tuple:
    """(the consent this start spends, or None; lines to say; a refusal, or None)."""
    if flags.resume_from is None and not flags.fresh_start:
        return None, (), None
    text = f"--resume-from {tag_of(flags.resume_from)}" if flags.resume_from is not None \
        else "--fresh-start"
    newest = state[-1] if state else None
    newest_id = newest.id if newest else "none"
    again = (f"To apply it to the run as it is now: {text} --giving-up {newest_id}"
             if flags.giving_up != newest_id else "It was given on the run as it is now")
    # spent: the same command applied before; the bare flag, seen before at all (a requeue)
    spent = [r for r in records if r["kind"] == "consent" and r["flag"] == text
             and r.get("giving_up") == flags.giving_up
             and (r["outcome"] == "applied" or flags.giving_up is None)]
    if spent:
        first = spent[0]
        return None, (
            f"tupe-pretrain: {text} was spent by an earlier attempt (on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(first['time']))}, when the run's "
            f"newest checkpoint was {first['given_on']}; "
            + (f"it gave up {len(first['gives_up'])} checkpoint(s)"
               if first["outcome"] == "applied" else "not taken then")
            + f"): not applied again. {again}",), None
    if flags.giving_up is not None and flags.giving_up != newest_id:
        named = next((c for c in state if c.id == flags.giving_up), None)
        return None, (
            f"tupe-pretrain: {text} --giving-up {flags.giving_up}: that "
            + (f"is {tag_of(named.step)}, not the run's newest checkpoint" if named
               else "is no live checkpoint of the run")
            + f" ({f'{tag_of(newest.step)}, id {newest.id}' if newest else 'none'}): not "
            f"applied. {again}",), None
    target, ours = complete.get(flags.resume_from), None  # --fresh-start: pending until chosen
    if not flags.fresh_start:
        ours = next((c for c in state if target and c.id == target.id), None)
        if ours is None:
            held = [c.step for c in state if complete.get(c.step) and complete[c.step].id == c.id]
            why = "is another run's checkpoint" if target else \
                "is not a complete checkpoint of the run (its manifest.json is missing or damaged)"
            return None, (), (f"--resume-from {tag_of(flags.resume_from)}: "
                              f"{tag_of(flags.resume_from)} {why}; complete ones: "
                              f"{tags(held) or 'none'}")
    return record("consent", flag=text, given_on=newest_id, giving_up=flags.giving_up,
                  outcome="applied" if ours else "pending", target=ours and ours.id,
                  gives_up=[c.id for c in state if not ours or c.step > ours.step]), (), None


def attempt_fields(lineage_: str, settings: dict, sources: dict) -> dict:
    return {"job": os.environ.get("SLURM_JOB_ID"), "restart": os.environ.get(
        "SLURM_RESTART_COUNT"), "host": socket.gethostname(), "pid": os.getpid(),
        "lineage": lineage_, "settings": settings, "sources": sources}
