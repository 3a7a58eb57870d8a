"""OUT/history.jsonl: the one history of a run, and the decision every start makes from it.

Each line is one record, appended and fsynced (the file, and its folder when it is new), with its
sequence number and a checksum of its own:

    attempt    a start: its job, restart count, host, lineage, settings and where each came from
    committed  a checkpoint whose manifest is written: its id (its own, not its step), step,
               lineage and files (size and checksum each)
    set_aside  a checkpoint folder moved into CHECKPOINTS/set-aside/ (its id when it had one)
    retired    a checkpoint retention removed
    consent    --resume-from or --fresh-start, spent: the state it was given on (the newest live
               checkpoint's id), the checkpoints it gave up and the one it resumed

Every start decides from the history and the folder's listing, nothing else (`decide`, a pure
function: tests/test_history.py runs it through thousands of random histories). A torn last line
(a kill mid-append) is ignored; damage anywhere else refuses, saying what to do. A history that is
lost is rebuilt from the checkpoints' own manifests, which carry their id and every consent the run
had spent when they were written, so that a lost history never forgets spent consent
(`rebuilt`). run.json is a description of the run for other tools, not a source of decisions.

Consent is bound to a state: `--resume-from stepN` and `--fresh-start` apply once, to the state
they are first given on. The same flag given again (a requeued job's script repeats it) is spent
and said; to give it again on the state of now, the command names what it gives up:
`--giving-up ID`, the id of the run's newest live checkpoint, which every line that suggests it
prints.
"""

import dataclasses
import json
import os
import socket
import time
import uuid
from typing import Dict, List, Optional, Tuple

import xxhash

from tupe_ds.tools.files import NotRegularFile, sync_folder
from tupe_ds.train.checkpoint import reads

FILE = "history.jsonl"
KINDS = ("attempt", "committed", "set_aside", "retired", "consent")


class HistoryDamaged(ValueError):
    """OUT/history.jsonl holds a record, not its last, that does not read: refused, with what to
    do (it is never rewritten or guessed around)."""


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def checkpoint_id(manifest: dict) -> str:
    """A checkpoint's identity: its manifest's id; for one written before ids, the checksum its
    manifest records of itself (or its lineage and step, for the earliest)."""
    return str(manifest.get("id") or manifest.get("manifest_xxh3_128", "")[:16]
               or f"{manifest.get('lineage')}-{manifest.get('step')}")


# --- the file ------------------------------------------------------------------------------------

def record_checksum(record: dict) -> str:
    body = {key: value for key, value in record.items() if key != "xxh3_64"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def read(out: str) -> Optional[List[dict]]:
    """The records of OUT/history.jsonl, oldest first; None when there is no history. A torn
    last line is dropped; HistoryDamaged for any other line that is no record in sequence;
    reads.Unreadable when the filesystem does not give the file for the retry window."""
    path = os.path.join(out, FILE)
    try:
        data = reads.read_bytes(path, root=out)
    except FileNotFoundError:
        return None
    except NotRegularFile as error:
        raise HistoryDamaged(str(error)) from None
    return parsed(data, path)[0]


def parsed(data: bytes, path: str) -> Tuple[List[dict], int]:
    """(the records, the length of the bytes that hold them): a last line that is no record
    (torn by a kill, or written whole but not synced before a crash) is not one of them."""
    lines = data.split(b"\n")
    torn = lines.pop()  # after the last newline: b"" unless a kill cut an append short
    records, length = [], 0
    for number, line in enumerate(lines, start=1):
        problem = line_problem(line, number)
        if problem and number == len(lines) and not torn:
            break
        if problem:
            raise HistoryDamaged(
                f"{path}, line {number}: {problem}. The history is never guessed around: move "
                f"the file aside (mv {path} {path}.damaged) and run the same command; the "
                "history is then made again from the checkpoints' manifests")
        records.append(json.loads(line))
        length += len(line) + 1
    return records, length


def line_problem(line: bytes, number: int) -> Optional[str]:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        return f"not JSON ({error})"
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return "not a record of a run's history"
    if record.get("xxh3_64") != record_checksum(record):
        return "its checksum differs from its content"
    if record.get("seq") != number:
        return f"numbered {record.get('seq')!r}, not {number}"
    return None


def record(kind: str, **fields) -> dict:
    """A record not yet in the history (`append` numbers it)."""
    return {"kind": kind, "time": time.time(), **fields}


def append(out: str, records: List[dict], new: List[dict]) -> None:
    """Appends `new` (records made by `record`) to OUT/history.jsonl and to `records` (the
    history as read), numbered and checksummed, durable before it returns (the file, and its
    folder when the file is new); a torn last line a kill left is cut off first."""
    if not new:
        return
    lines = []
    for item in new:
        numbered = {**{k: v for k, v in item.items() if k not in ("seq", "xxh3_64")},
                    "seq": len(records) + 1}
        numbered["xxh3_64"] = record_checksum(numbered)
        records.append(numbered)
        lines.append(json.dumps(numbered, sort_keys=True).encode() + b"\n")
    path = os.path.join(out, FILE)
    created = not os.path.exists(path)
    with open(path, "ab") as f:
        if f.tell():  # what a kill or crash left after the last record goes
            with open(path, "rb") as existing:
                f.truncate(parsed(existing.read(), path)[1])
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    if created:
        sync_folder(out)


# --- the state a history gives -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Checkpoint:
    id: str
    step: int
    lineage: str


def live(records: List[dict]) -> List[Checkpoint]:
    """The checkpoints the run committed and has neither set aside, retired nor given up by
    consent, in the order they were committed."""
    gone = set()
    for item in records:
        if item["kind"] in ("set_aside", "retired"):
            gone.add(item.get("id"))
        elif item["kind"] == "consent" and item["outcome"] == "applied":
            gone.update(item["gives_up"])
    return [Checkpoint(r["id"], r["step"], r["lineage"]) for r in records
            if r["kind"] == "committed" and r["id"] not in gone]


def known(records: List[dict]) -> set:
    """(id, step) of every checkpoint the history records committed: a folder holding a copy
    of one under another step is another checkpoint."""
    return {(r["id"], r["step"]) for r in records if r["kind"] == "committed"}


def consents(records: List[dict]) -> List[dict]:
    """The consents spent, as each checkpoint's manifest carries them (without sequence and
    checksum, which belong to one history)."""
    return [{k: v for k, v in r.items() if k not in ("seq", "xxh3_64", "rebuilt")}
            for r in records if r["kind"] == "consent"]


def lineage(records: List[dict]) -> Optional[str]:
    """The run's lineage: the last attempt's."""
    return next((r["lineage"] for r in reversed(records) if r["kind"] == "attempt"), None)


def recorded_settings(records: List[dict]) -> Optional[Tuple[dict, int]]:
    """The settings of the last attempt, with its sequence number."""
    for item in reversed(records):
        if item["kind"] == "attempt" and isinstance(item.get("settings"), dict):
            return item["settings"], item.get("seq")
    return None


# --- the listing ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Folder:
    """A stepN folder of CHECKPOINTS: its manifest's id and lineage when it reads (complete),
    else why not (`problem`: damaged, or None with no id: incomplete)."""
    step: int
    id: Optional[str] = None
    lineage: Optional[str] = None
    problem: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Listing:
    folders: Tuple[Folder, ...]  # ascending steps

    def complete(self) -> Dict[int, Folder]:
        return {f.step: f for f in self.folders if f.id is not None}


@dataclasses.dataclass(frozen=True)
class Flags:
    resume_from: Optional[int] = None  # the step --resume-from names
    fresh_start: bool = False
    giving_up: Optional[str] = None  # --giving-up ID


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a start goes on from: `candidates` (steps, newest first: the one to resume, then
    the fallbacks should its files not verify) or a refusal; the records to append first
    (adoptions, the consent spent); lines to say."""
    candidates: Tuple[int, ...] = ()
    refusal: Optional[str] = None
    appends: Tuple[dict, ...] = ()
    notes: Tuple[str, ...] = ()
    by_hand: bool = False  # --resume-from: that checkpoint or a refusal
    fresh_start: Optional[dict] = None  # the --fresh-start consent, spent if none verifies


def tag(step: int) -> str:
    return f"step{step}"


def tags(steps) -> str:
    return ", ".join(tag(s) for s in sorted(steps))


def flag_text(flags: Flags) -> str:
    return f"--resume-from {tag(flags.resume_from)}" if flags.resume_from is not None \
        else "--fresh-start"


def decide(records: List[dict], listing: Listing, flags: Flags, run_lineage: str) -> Decision:
    """Where this start goes on from, from the history and what the folder holds (pure). The
    start is never older than the newest intact checkpoint of the history unless a consent
    spent now names that state; a checkpoint the history holds live that is not in the folder
    refuses; nothing is given up without consent."""
    complete = listing.complete()
    committed = known(records)
    appends = [record("committed", id=f.id, step=f.step, lineage=f.lineage, adopted=True)
               for f in complete.values() if f.lineage == run_lineage
               and (f.id, f.step) not in committed]
    # a commit cut short before its record is adopted; by step, as a history made again (or one
    # lost while the run went on) records them out of order
    state = sorted(live([*records, *appends]), key=lambda c: c.step)
    newest = state[-1] if state else None
    consent, notes, refusal = consent_of(records, flags, newest, state, complete)
    given_up = frozenset(consent["gives_up"]) if consent and consent["outcome"] == "applied" \
        else frozenset()
    kept = [c for c in state if c.id not in given_up]
    on_disk = {c.id: c for c in kept if complete.get(c.step) and complete[c.step].id == c.id}
    # set aside by hand is no consent: only the history's own set_aside records take a
    # checkpoint out of the run's state
    lost = [c for c in kept if c.id not in on_disk
            and not any(f.step == c.step and f.id is None for f in listing.folders)]
    resumable = [c.step for c in reversed(kept) if c.id in on_disk]
    if refusal:
        return Decision(refusal=refusal, notes=tuple(notes))
    if consent and consent["flag"].startswith("--resume-from") and consent["outcome"] == "applied":
        return Decision((consent_step(consent, state),), appends=(*appends, consent),
                        notes=tuple(notes), by_hand=True)
    fresh = consent if consent and consent["flag"] == "--fresh-start" else None
    if lost and (lost[-1].step > resumable[0] if resumable else fresh is None):
        newest_id = kept[-1].id
        on = f"go on from {tag(resumable[0])} deliberately, giving up " + tags(
            c.step for c in kept if c.step > resumable[0]) + f": --resume-from " \
            f"{tag(resumable[0])} --giving-up {newest_id}" if resumable else \
            f"start over from step 0: --fresh-start --giving-up {newest_id}"
        return Decision(refusal=(
            f"the run's history records {tags(c.step for c in lost)} as committed (id "
            f"{', '.join(c.id for c in lost)}), but the folder holds none of it (was it moved or "
            "lost? a folder set aside by hand is not given up). Nothing was moved or deleted. "
            f"Put it back and run the same command; or {on}"), notes=tuple(notes))
    return Decision(tuple(resumable), appends=tuple(appends), notes=tuple(notes),
                    fresh_start=fresh)


def consent_step(consent: dict, state: List[Checkpoint]) -> int:
    return next(c.step for c in state if c.id == consent["target"])


def consent_of(records: List[dict], flags: Flags, newest: Optional[Checkpoint],
               state: List[Checkpoint], complete: Dict[int, Folder]) -> tuple:
    """(the consent this start spends, or None; lines to say; a refusal, or None)."""
    if flags.resume_from is None and not flags.fresh_start:
        return None, [], None
    text, newest_id = flag_text(flags), newest.id if newest else "none"
    again = f"{text} --giving-up {newest_id}"
    # spent: the same command (flag and --giving-up) applied before; or, the bare flag, seen
    # before at all (a requeued script repeats it)
    spent = [r for r in records if r["kind"] == "consent" and r["flag"] == text
             and r.get("giving_up") == flags.giving_up
             and (r["outcome"] == "applied" or flags.giving_up is None)]
    if spent:
        first = spent[0]
        return None, [
            f"tupe-pretrain: {text} was spent by an earlier attempt (on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(first['time']))}, when the "
            f"run's newest checkpoint was {first['given_on']}; "
            + (f"it gave up {len(first['gives_up'])} checkpoint(s)" if first["outcome"] == "applied"
               else "not taken then") + f"): not applied again. To apply it to the run as it is "
            f"now: {again}"], None
    if flags.giving_up is not None and flags.giving_up != newest_id:
        named = next((c for c in state if c.id == flags.giving_up), None)
        return None, [
            f"tupe-pretrain: {text} --giving-up {flags.giving_up}: that "
            + (f"is {tag(named.step)}, not the run's newest checkpoint" if named else
               "is no live checkpoint of the run")
            + f" ({tag(newest.step) + ', id ' + newest.id if newest else 'none'}): not applied. "
            f"To apply it to the run as it is now: {again}"], None
    if flags.fresh_start:
        return record("consent", flag=text, given_on=newest_id, giving_up=flags.giving_up,
                      outcome="pending", gives_up=[c.id for c in state], target=None), [], None
    target = complete.get(flags.resume_from)
    ours = next((c for c in state if target and c.id == target.id), None)
    if ours is None:
        held = [c.step for c in state if complete.get(c.step) and complete[c.step].id == c.id]
        why = ("is another run's checkpoint" if target else "is not a complete checkpoint of "
               "the run (no manifest.json)")
        return None, [], (f"--resume-from {tag(flags.resume_from)}: {tag(flags.resume_from)} "
                          f"{why}; complete ones: {tags(held) or 'none'}")
    return record("consent", flag=text, given_on=newest_id, giving_up=flags.giving_up,
                  outcome="applied", gives_up=[c.id for c in state if c.step > ours.step],
                  target=ours.id), [], None


# --- the shell around it -------------------------------------------------------------------------

def rebuilt(records: List[dict], manifests: Dict[str, dict], set_aside: Dict[str, dict],
            earlier: List[str] = ()) -> List[dict]:
    """What the history lacks of what the checkpoints' manifests record (`manifests`: the step
    folders', `set_aside`: those set aside, by id): every consent they carry that it does not
    hold (a history cut short or emptied forgets none); and when there is no history
    (`records` empty), each checkpoint committed in the order of its step, those set aside
    recorded so, and the --resume-from steps an earlier tupe_ds recorded as applied
    (`earlier`)."""
    new = []
    every = sorted([*manifests.values(), *set_aside.values()], key=lambda m: m["step"])
    if not records:
        new += [record("committed", id=checkpoint_id(m), step=m["step"], lineage=m["lineage"],
                       files=m["files"], rebuilt=True) for m in every]
        new += [record("set_aside", id=id_, step=m["step"], rebuilt=True)
                for id_, m in set_aside.items()]
        new += [record("consent", flag=f"--resume-from {step}", given_on="an earlier tupe_ds",
                       outcome="applied", gives_up=[], target=None, rebuilt=True)
                for step in sorted(set(earlier))]
    for manifest in every:
        for consent in manifest.get("consents", ()):
            if isinstance(consent, dict) and not any(
                    r["kind"] == "consent" and all(r.get(k) == consent.get(k) for k in
                                                   ("flag", "given_on", "outcome"))
                    for r in [*records, *new]):
                new.append(record("consent", **{k: v for k, v in consent.items()
                                                if k not in ("kind", "seq", "xxh3_64")},
                                  rebuilt=True))
    return new


def attempt_fields(lineage_: str, settings: dict, sources: dict) -> dict:
    return {"job": os.environ.get("SLURM_JOB_ID"), "restart": os.environ.get(
        "SLURM_RESTART_COUNT"), "host": socket.gethostname(), "pid": os.getpid(),
        "lineage": lineage_, "settings": settings, "sources": sources}
