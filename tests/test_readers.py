"""Every reader of a run's state on disk, on damaged input (property-based, with hypothesis):
random bytes, truncations and bit flips of a valid file, valid JSON of other types and shapes,
and valid-looking records with one field changed, renamed or removed. Each reader returns a good
value, its documented fallback (None, a "damaged" entry, a problem line) or raises its documented
clear error (ValueError, RunFolderBusy) naming the file; never another exception (KeyError,
TypeError, AttributeError, UnicodeDecodeError, RecursionError, ...), which would end a run's
start with a traceback instead of a sentence saying what is wrong.

Each example makes a folder of its own (tempfile): hypothesis runs every example of a test within
one call of the test function, for which pytest's tmp_path is made once."""

import copy
import io
import json
import os
import re
import subprocess
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from logged import logged_lines
from tupe_ds.tools.errors import RunFolderBusy
from tupe_ds.tools.lock import this_holder
from tupe_ds.train import monitor
from tupe_ds.train.checkpoint import folder, history, manifest, reshard, resume, same_run
from tupe_ds.train.run_folder import description as folder_description
from tupe_ds.train.run_folder import lock as folder_lock
from tupe_ds.train.run_folder.lock import RunLock


def at_most(examples: int):
    # the suite's autouse fixture (conftest.py: DeepSpeed's shared memory) is function-scoped;
    # it only cleans up after the test, so sharing it across examples is harmless
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- what good files hold ------------------------------------------------------------------

LAYOUT = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 2, "micro_batch": 8,
          "gradient_accumulation": 1, "vocab_size": 1024}
IDENTITY = {"objective": "electra", "model": "tiny", "seed": 1234, "seq_len": 128,
            "loss_normalization": "token", "global_batch": 16,
            "masking": {"probability": 0.15, "whole_word": False},
            "vocabulary": "ab" * 32, "data": {"train": "cd" * 32, "valid": "ef" * 32},
            "models": [{"hidden_size": 64, "num_layers": 2, "vocab_size": 1024},
                       {"hidden_size": 128, "num_layers": 2, "vocab_size": 1024}]}
TRAINING = {"optimizer": {"type": "AdamW", "params": {"lr": 0.0005}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
            "gradient_clipping": 1.0}
RUN = {"objective": "electra", "data": "/data/tiny", "tp": 1, "pp": 1,
       "models": [{"hidden_size": 64}], "lineage": "L"}
FILES = {"mp_rank_00_model_states.pt": {"size": 1641, "xxh3_128": "0f" * 16},
         "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"size": 1641, "xxh3_128": "1e" * 16},
         "layout.json": {"size": 150, "xxh3_128": "2d" * 16}}


def manifest_record(step: int, lineage: str = "L") -> dict:
    return {"format": manifest.FORMAT, "tag": f"step{step}", "step": step, "lineage": lineage,
            "identity": IDENTITY, "layout": LAYOUT, "training": TRAINING, "files": FILES}


def encoded(record) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def torch_file(**kwargs) -> bytes:
    buffer = io.BytesIO()
    torch.save({"module": {"weight": torch.arange(6.0).reshape(2, 3)}, "step": 3,
                "names": ["a", "b"], "scale": 2.5}, buffer, **kwargs)
    return buffer.getvalue()


PICKLE = torch_file()  # torch's zip format
OLD_PICKLE = torch_file(_use_new_zipfile_serialization=False)  # torch's older format


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def good_checkpoint(directory: str, step: int, lineage: str = "L") -> str:
    """A complete checkpoint as tupe-pretrain's save leaves it (no DeepSpeed run): its files,
    then its manifest."""
    step_dir = os.path.join(directory, f"step{step}")
    os.makedirs(step_dir)
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for name in names:
        write_bytes(os.path.join(step_dir, name), PICKLE)
    write_bytes(os.path.join(step_dir, reshard.LAYOUT_FILE), json.dumps(LAYOUT).encode())
    names.append(reshard.LAYOUT_FILE)
    manifest.write(step_dir, {"tag": f"step{step}", "step": step, "lineage": lineage,
                              "identity": IDENTITY, "layout": LAYOUT, "training": TRAINING,
                              "files": manifest.describe(step_dir, names)})
    return step_dir


# --- damage ------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
           | st.text(max_size=10))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
awkward_names = st.sampled_from(["", ".", "..", "manifest.json", "a/b", "/etc/passwd", "step8",
                                 "x" * 300, "nul\x00byte"]) | st.text(max_size=12)


def like(value) -> st.SearchStrategy:
    """Another value of the JSON type of `value` (a record that still looks valid)."""
    if type(value) is int:
        return st.integers(-2, 2 ** 40) | st.integers(value - 2, value + 2)
    if isinstance(value, str):
        return st.text(max_size=len(value) + 2)
    if isinstance(value, float):
        return st.floats()
    if isinstance(value, dict):
        return st.dictionaries(st.text(max_size=8), scalars, max_size=3)
    if isinstance(value, list):
        return st.lists(st.dictionaries(st.text(max_size=8), scalars, max_size=3), max_size=3)
    return json_values


@st.composite
def mutated(draw, record):
    """`record` with one field, at any depth, given another JSON value (often of the same type),
    renamed or removed."""
    record = copy.deepcopy(record)
    holder = record
    while True:  # each field of a level as likely as the next, however much it holds
        last = draw(st.sampled_from(list(holder) if isinstance(holder, dict)
                                    else range(len(holder))))
        if not (isinstance(holder[last], (dict, list)) and holder[last] and draw(st.booleans())):
            break
        holder = holder[last]
    how = draw(st.sampled_from(["replace", "remove", "rename"]) if isinstance(holder, dict)
               else st.just("replace"))
    if how == "remove":
        del holder[last]
    elif how == "rename":
        holder[draw(awkward_names)] = holder.pop(last)
    else:
        holder[last] = draw(like(holder[last]) | json_values)
    return record


def retyped(record: dict) -> st.SearchStrategy:
    """`record` with any of its fields given another JSON value or removed."""
    gone = object()
    return st.fixed_dictionaries({key: st.just(value) | st.just(gone) | like(value) | json_values
                                  for key, value in record.items()}).map(
        lambda fields: {key: value for key, value in fields.items() if value is not gone})


def flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


def damaged_bytes(valid: bytes) -> st.SearchStrategy:
    """Random bytes, a truncation (a write cut short), a bit flip, or `valid` not in UTF-8."""
    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),
        st.integers(0, len(valid) * 8 - 1).map(lambda bit: flip(valid, bit)),
        st.sampled_from(["utf-16", "utf-32", "latin-1"]).map(
            lambda codec: valid.decode().replace('"', '"\u00e9', 1).encode(codec)),
        st.integers(0, len(valid)).map(lambda n: valid[:n] + b"\xff\xfe" + valid[n:]))


def damaged(record) -> st.SearchStrategy:
    """The bytes of a file that should hold `record` (a JSON object), damaged: see
    damaged_bytes, or valid JSON of another type or shape, or `record` with one field mutated
    or several retyped (either may leave it valid)."""
    return st.one_of(damaged_bytes(encoded(record)), json_values.map(encoded),
                     mutated(record).map(encoded), retyped(record).map(encoded))


def with_field(record: dict, field: str, values: st.SearchStrategy) -> st.SearchStrategy:
    """The bytes of `record` with `field` taking `values`."""
    return values.map(lambda value: encoded({**record, field: value}))


def names_the_file(error: Exception, path: str) -> bool:
    return str(error).startswith(f"{path}: ")


# --- checkpoint/manifest.py --------------------------------------------------------------------

def assert_is_a_manifest(record, tag: str) -> None:
    """What manifest.read's docstring promises a caller (and the module's docstring shows)."""
    assert isinstance(record, dict) and record["format"] == manifest.FORMAT
    assert record["tag"] == tag and type(record["step"]) is int and f"step{record['step']}" == tag
    assert isinstance(record["lineage"], str)
    for field in ("identity", "layout", "files"):
        assert isinstance(record[field], dict)
    assert isinstance(record.get("training", {}), dict)
    for name, entry in record["files"].items():
        assert "/" not in name and name not in ("", ".", "..", manifest.MANIFEST)
        assert type(entry["size"]) is int and entry["size"] >= 0
        assert isinstance(entry["xxh3_128"], str)


@at_most(150)
@given(data=damaged(manifest_record(8)) | with_field(
    manifest_record(8), "files", json_values | mutated(FILES) | retyped(FILES)))
@example(data=encoded(manifest_record(8)))
def test_manifest_read_returns_a_manifest_or_a_value_error_naming_it(data):
    """manifest.read: a manifest whose every field has the type its readers use, or ValueError
    naming STEP/manifest.json."""
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = os.path.join(tmp, "step8")
        os.makedirs(step_dir)
        write_bytes(os.path.join(step_dir, manifest.MANIFEST), data)
        try:
            record = manifest.read(step_dir)
        except ValueError as error:
            event("ValueError")
            assert names_the_file(error, os.path.join(step_dir, manifest.MANIFEST)), error
            return
        event("a manifest")
        assert_is_a_manifest(record, "step8")
        assert record == json.loads(data)


file_damage = st.sampled_from(["intact", "removed", "truncated", "extended", "overwritten",
                               "a folder"])
extra_names = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1,
                      max_size=16).filter(lambda n: n not in (".", "..", manifest.MANIFEST))


@at_most(60)
@given(damage=st.fixed_dictionaries({name: file_damage for name in FILES}),
       cut=st.integers(0, len(PICKLE) - 1), noise=st.binary(min_size=1, max_size=len(PICKLE)),
       extras=st.lists(st.tuples(extra_names, st.booleans()), max_size=3))
@pytest.mark.slow
def test_check_files_and_unlisted_name_each_damaged_file_in_a_line(damage, cut, noise, extras):
    """manifest.check_files on a checkpoint whose files were removed, truncated, extended,
    overwritten or replaced by a folder: exactly one line per changed file, naming it, none for
    an intact one; manifest.unlisted: exactly one line per entry the manifest does not list."""
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = good_checkpoint(tmp, 8)
        files = manifest.read(step_dir)["files"]
        changed = set()
        for name, how in damage.items():
            path = os.path.join(step_dir, name)
            before = read_bytes(path)
            if how == "removed":
                os.remove(path)
            elif how == "a folder":
                os.remove(path)
                os.makedirs(path)
            elif how == "truncated":
                write_bytes(path, before[:cut % len(before)])
            elif how == "extended":
                write_bytes(path, before + noise)
            elif how == "overwritten":
                write_bytes(path, (noise * len(before))[:len(before)])
            if how in ("removed", "a folder") or read_bytes(path) != before:
                changed.add(name)
        extra = set()
        for name, is_folder in extras:
            path = os.path.join(step_dir, name)
            if os.path.exists(path):
                continue
            if is_folder:
                os.makedirs(path)
            else:
                write_bytes(path, noise)
            extra.add(name)
        problems = manifest.check_files(step_dir, files)
        event(f"{len(changed)} changed, {len(extra)} extra")
        assert all(isinstance(line, str) for line in problems)
        named = [line.split(": ")[0] for line in problems]
        assert named == sorted(os.path.join(step_dir, name) for name in changed)
        lines = manifest.unlisted(step_dir, files)
        assert len(lines) == len(extra) and all(
            line.startswith(os.path.join(step_dir, name) + ": ")
            for line, name in zip(lines, sorted(extra)))


@at_most(100)
@given(data=st.one_of(st.integers(0, len(PICKLE) - 1).map(lambda n: PICKLE[:n]),
                      st.integers(0, len(OLD_PICKLE) - 1).map(lambda n: OLD_PICKLE[:n]),
                      st.integers(0, len(PICKLE) * 8 - 1).map(lambda b: flip(PICKLE, b)),
                      st.integers(0, len(OLD_PICKLE) * 8 - 1).map(lambda b: flip(OLD_PICKLE, b)),
                      st.binary(max_size=64)))
@example(data=b"")  # a file a save created but never wrote to
@example(data=OLD_PICKLE[:18])
def test_check_files_reads_a_damaged_pickle_the_manifest_agrees_with_as_a_line(data):
    """manifest.check_files on a file whose size and checksum the manifest records, but whose
    pickle is damaged (a checkpoint put together elsewhere: safe_load.scan is the guard): no
    line (it loads with weights_only) or one line naming it."""
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = good_checkpoint(tmp, 8)
        name = "mp_rank_00_model_states.pt"
        write_bytes(os.path.join(step_dir, name), data)
        files = manifest.describe(step_dir, sorted(os.listdir(step_dir)))
        del files[manifest.MANIFEST]
        problems = manifest.check_files(step_dir, files)
        event(f"{len(problems)} lines")
        assert all(line.startswith(os.path.join(step_dir, name) + ": ") for line in problems)
        assert len(problems) <= 1


# --- checkpoint/folder.py ----------------------------------------------------------------------

def step_manifest(step: int) -> st.SearchStrategy:
    """What a step folder holds: a good manifest, none (a save cut short), or damaged bytes
    (among them a good manifest but for its layout)."""
    return st.sampled_from(["good", "none"]) | damaged(manifest_record(step)) | with_field(
        manifest_record(step), "layout", json_values | mutated(LAYOUT) | retyped(LAYOUT))


@st.composite
def checkpoints_folders(draw, lineages=("L",)):
    """{step: "good"/"none"/bytes}, the lineage of each good one, and `latest`'s content (None:
    no such file; "a folder")."""
    steps = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
    content = {step: draw(step_manifest(step)) for step in steps}
    lineage = {step: draw(st.sampled_from(lineages)) for step in steps}
    latest = draw(st.none() | st.just("a folder") | st.binary(max_size=12)
                  | st.sampled_from(steps).map(lambda s: f" step{s}\n".encode()))
    return content, lineage, latest


def plant(directory: str, content: dict, lineage: dict, latest) -> None:
    os.makedirs(directory, exist_ok=True)
    for step, what in content.items():
        if what == "good":
            good_checkpoint(directory, step, lineage[step])
        else:
            step_dir = os.path.join(directory, f"step{step}")
            os.makedirs(step_dir)
            write_bytes(os.path.join(step_dir, "mp_rank_00_model_states.pt"), PICKLE)
            if what != "none":
                write_bytes(os.path.join(step_dir, manifest.MANIFEST), what)
    if latest == "a folder":
        os.makedirs(os.path.join(directory, "latest"))
    elif latest is not None:
        write_bytes(os.path.join(directory, "latest"), latest)


@at_most(80)
@given(folder_content=checkpoints_folders())
def test_survey_sorts_each_step_folder_into_complete_or_damaged(folder_content):
    """folder.survey: every step folder with a manifest is complete (its manifest, readable,
    with a layout) or damaged (a line naming it), never both, and it never raises; a good one
    is complete. complete_steps and latest_step follow from it (`latest` random)."""
    content, lineage, latest = folder_content
    with tempfile.TemporaryDirectory() as tmp:
        plant(tmp, content, lineage, latest)
        complete, damaged_steps = folder.survey(tmp)
        event(f"{len(complete)} complete, {len(damaged_steps)} damaged")
        with_manifest = {s for s, what in content.items() if what != "none"}
        assert set(complete) | set(damaged_steps) == with_manifest
        assert not set(complete) & set(damaged_steps)
        assert {s for s, what in content.items() if what == "good"} <= set(complete)
        for step, record in complete.items():
            assert_is_a_manifest(record, f"step{step}")
            assert isinstance(reshard.saved_layout(record), reshard.SavedLayout)
        for step, line in damaged_steps.items():
            assert isinstance(line, str) and f"step{step}" in line
        assert folder.complete_steps(tmp) == sorted(complete)
        assert folder.latest_step(tmp) == (max(complete) if complete else 0)


# --- checkpoint/reshard.py ---------------------------------------------------------------------

@at_most(150)
@given(layout=json_values | mutated(LAYOUT) | retyped(LAYOUT))
@example(layout=LAYOUT)
def test_a_layout_reads_as_counts_or_a_value_error(layout):
    """reshard.SavedLayout.from_record: a layout of non-negative int fields, or ValueError;
    saved_layout on an otherwise good manifest record: that, or ValueError naming the
    checkpoint."""
    try:
        saved = reshard.SavedLayout.from_record(layout)
    except ValueError:
        saved = None
    else:
        event("a layout")
        assert all(type(getattr(saved, name)) is int and getattr(saved, name) >= 0
                   for name in LAYOUT)
    record = {**manifest_record(8), "layout": layout}
    try:
        assert reshard.saved_layout(record) == saved
    except ValueError as error:
        assert saved is None
        assert str(error).startswith("checkpoint step8: its manifest's layout is damaged (")


# --- checkpoint/same_run.py ----------------------------------------------------------------

@at_most(150)
@given(saved=json_values | mutated(IDENTITY) | mutated(TRAINING))
@example(saved=IDENTITY)
def test_identity_differences_are_lines_whatever_the_manifest_records(saved):
    """same_run.differences(saved, current) with whatever JSON a damaged-but-parseable
    manifest's identity holds: a list of lines, never an exception; none when nothing differs,
    and a line naming each top-level setting that does."""
    lines = same_run.differences(saved, IDENTITY)
    event(f"{min(len(lines), 3)}+ lines")
    assert isinstance(lines, list) and all(isinstance(line, str) for line in lines)
    if saved == IDENTITY:
        assert lines == []
    if isinstance(saved, dict) and all(k and "." not in k and "[" not in k for k in saved):
        for key, value in IDENTITY.items():
            if not isinstance(value, (dict, list)) and key in saved \
                    and not isinstance(saved[key], (dict, list)) and saved[key] != value:
                assert any(key in line for line in lines), (key, lines)
    assert isinstance(same_run.differences(saved, TRAINING), list)


# --- run_folder/description.py -----------------------------------------------------------------

@at_most(150)
@given(data=st.none() | st.just("a folder") | damaged(RUN)
       | with_field(RUN, "lineage", json_values))
@example(data=encoded(RUN))
def test_run_description_reads_or_names_run_json(data):
    """folder_description.read: a description with the fields its readers use, or ValueError
    naming OUT/run.json (missing too); lineage: its lineage or None, never an exception."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, folder_description.FILE)
        if data == "a folder":
            os.makedirs(path)
        elif data is not None:
            write_bytes(path, data)
        try:
            description = folder_description.read(out)
        except ValueError as error:
            event("ValueError")
            assert names_the_file(error, path), error
            assert folder_description.lineage(out) is None
            return
        event("a description")
        assert isinstance(description, dict)
        for field, kind in folder_description.FIELDS.items():
            assert isinstance(description[field], kind) and type(description[field]) is not bool
        assert all(isinstance(model, dict) for model in description["models"])
        recorded = description.get("lineage")
        assert folder_description.lineage(out) == (recorded if isinstance(recorded, str)
                                                and recorded else None)


# --- run_folder/lock.py ------------------------------------------------------------------------

def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


LIVE_HOLDER = {**this_holder(), "token": "f" * 32,
               "started": "2026-11-26T00:00:00+00:00", "slurm_job_id": "41", "slurm_step_id": "0"}
DEAD_HOLDER = {**LIVE_HOLDER, "pid": dead_pid()}
OTHER_HOST = {**LIVE_HOLDER, "host": "node-that-is-not-this-one"}
lock_records = damaged(LIVE_HOLDER) | damaged(DEAD_HOLDER) | damaged(OTHER_HOST)


@at_most(200)
@given(data=lock_records)
def test_parse_holder_is_a_holder_or_none(data):
    """folder_lock.parse_holder: a holder with the fields the lock's rules read (token, host, an
    int pid), or None when the bytes are no lock record."""
    holder = folder_lock.parse_holder(data)
    event(f"a holder: {holder is not None}")
    if holder is not None:
        assert isinstance(holder, dict) and isinstance(holder["token"], str)
        assert isinstance(holder["host"], str) and type(holder["pid"]) is int
        assert isinstance(folder_lock.describe(holder), str)


@at_most(60)
@given(data=lock_records)
@example(data=encoded(LIVE_HOLDER))
@example(data=encoded(DEAD_HOLDER))
def test_a_run_lock_of_any_content_is_taken_over_or_refused_naming_it(data):
    """folder_lock.check (--check-only): None or the refusal, naming OUT/run.lock. RunLock.acquire
    over it: takes it over, saying so (always when it is no lock record), or RunFolderBusy
    naming it, leaving it as it was, exactly when check said so. Released, nothing is left."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, folder_lock.LOCK_FILE)
        write_bytes(path, data)
        refusal = folder_lock.check(out)
        assert refusal is None or refusal.startswith(f"{path}: this run folder is in use by ")
        try:
            with logged_lines() as said:
                lock = RunLock.acquire(out)
        except RunFolderBusy as busy:
            event("busy")
            assert names_the_file(busy, path), busy
            assert folder_lock.parse_holder(data) is not None  # damaged is never busy
            assert refusal is not None and read_bytes(path) == data
            assert sorted(os.listdir(out)) == [folder_lock.LOCK_FILE]
            return
        event("taken over" + (" (damaged)" if folder_lock.parse_holder(data) is None else ""))
        try:
            assert refusal is None
            assert len(said) == 1 and said[0].startswith(f"tupe-pretrain: took over {path} ")
            if folder_lock.parse_holder(data) is None:
                assert said[0].endswith("the lock file is damaged (not a lock record)")
            assert folder_lock.parse_holder(read_bytes(path))["token"] == lock.holder["token"]
            assert lock.still_held() is None
        finally:
            lock.release()
        assert os.listdir(out) == []


# --- monitor.py --------------------------------------------------------------------------------

entries = st.builds(lambda step, extra: json.dumps({"step": step, **extra}).encode(),
                    st.integers(-3, 20), st.dictionaries(st.text(max_size=4), scalars,
                                                         max_size=2))
log_lines = st.one_of(
    entries, entries, entries,
    st.binary(max_size=30).filter(lambda line: b"\n" not in line),  # garbage
    json_values.map(lambda value: json.dumps(value).encode()),  # JSON that is no entry
    st.builds(lambda step: b'{"step": %d, "loss": 1.5e' % step, st.integers(0, 20)),  # cut short
    st.builds(lambda step, bad: b'{"step": %d, "note": "%s"}' % (step, bad),  # not UTF-8
              st.integers(0, 20), st.sampled_from([b"\xff", b"\xe9t\xe9", b"\xc3", b"\x80",
                                                   b"\xed\xa0\x80"])))


def log_entry_step(line: bytes):
    """The step of a line of train_log.jsonl (without its newline) that is a log entry: a JSON
    object in UTF-8 with an int step, as Monitor.scalars writes; None for any other line."""
    try:
        value = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and json's errors too
        return None
    step = value.get("step") if isinstance(value, dict) else None
    return step if type(step) is int else None


def lines_of(data: bytes) -> list:
    """The lines of a JSON-lines file, without their newlines (the last one may have none)."""
    lines = data.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


@at_most(100)
@given(lines=st.lists(log_lines, max_size=8), ends_with_newline=st.booleans(),
       step=st.integers(-1, 20), redone_before=st.sampled_from([b"", b'{"step": 3}\n']))
@example(lines=[b'{"step": 1}', b"\xff\xfe garbage", b'{"step": 5}', b'{"step": 2, "lo'],
         ends_with_newline=False, step=3, redone_before=b"")
@example(lines=[b"\r\x00"], ends_with_newline=False, step=0, redone_before=b"")  # a CR in garbage
@example(lines=[b'{"step": 1,\r"loss": 2.5}', b'{"step": 9}'],  # CR: JSON whitespace
         ends_with_newline=True, step=5, redone_before=b"")
@example(lines=[b'{"step": 1, "note": "\xed\xa0\x80"}', b'{"step": 9}'],  # a surrogate's bytes
         ends_with_newline=True, step=5, redone_before=b"")
def test_keep_log_until_keeps_the_entries_up_to_the_step_and_moves_every_other_line(
        lines, ends_with_newline, step, redone_before):
    """monitor.keep_log_until(log, step) on a train_log.jsonl of entries, garbage, JSON that is
    no entry, a last line cut short, bytes that are not UTF-8: afterwards the log holds exactly
    its entries of steps <= step, in order, each line valid JSON; every other line is appended
    to train_log.redone.jsonl; no line is lost or changed (but for the newline a last line cut
    short gets); it returns how many moved."""
    with tempfile.TemporaryDirectory() as out:
        log = os.path.join(out, "train_log.jsonl")
        redone = os.path.join(out, "train_log.redone.jsonl")
        original = b"\n".join(lines) + (b"\n" if ends_with_newline and lines else b"")
        write_bytes(log, original)
        if redone_before:
            write_bytes(redone, redone_before)
        moved = monitor.keep_log_until(log, step)
        event(f"moved {min(moved, 3)}+")
        on_disk = lines_of(original)
        kept_expected = [line for line in on_disk if log_entry_step(line) is not None
                         and log_entry_step(line) <= step]
        moved_expected = [line for line in on_disk if not (
            log_entry_step(line) is not None and log_entry_step(line) <= step)]
        after = read_bytes(log)
        kept = lines_of(after)
        assert kept == kept_expected
        assert all(log_entry_step(line) is not None for line in kept)
        assert moved == len(moved_expected)
        if moved:
            assert read_bytes(redone) == redone_before + b"".join(
                line + b"\n" for line in moved_expected)
        else:  # nothing to move: both files as they were (a newline may end the log)
            assert after in (original, original + b"\n")
            assert read_bytes(redone) == redone_before if redone_before else \
                not os.path.exists(redone)


# --- checkpoint/resume.py ----------------------------------------------------------------------

def plan_resume(out: str):
    return resume.plan_resume(out, "auto", None, world_size=2, tp=1, pp=1, zero_stage=2)


def begun(out: str) -> None:
    """The history a run of lineage L has once it started and saved the complete checkpoints of
    L in its folder (a history that never recorded two of them is an older copy)."""
    complete = folder.survey(os.path.join(out, "checkpoints"))[0]
    history.append(out, [], [history.record("attempt", lineage="L"), *(
        history.record("committed", id=history.checkpoint_id(record), step=step, lineage="L",
                       files=record["files"])
        for step, record in sorted(complete.items()) if record["lineage"] == "L")])


@at_most(60)
@given(folder_content=checkpoints_folders(lineages=("L", "M")), with_history=st.booleans())
def test_plan_resume_on_damaged_checkpoints_is_a_plan_none_or_a_value_error(folder_content,
                                                                            with_history):
    """resume.plan_resume("auto") on checkpoints some of whose manifests are damaged or mutated,
    of two lineages, with the run's history or none, and `latest` random: a plan of a complete
    checkpoint, with every newer damaged one passed over; None; or ValueError naming a
    checkpoint (always, with no history). Never another exception."""
    content, lineage, latest = folder_content
    with tempfile.TemporaryDirectory() as out:
        directory = os.path.join(out, "checkpoints")
        plant(directory, content, lineage, latest)
        if with_history:
            begun(out)
        complete, damaged_steps = folder.survey(directory)
        try:
            plan = plan_resume(out)
        except ValueError as error:
            event("ValueError")
            assert re.search(r"\bstep\d+\b", str(error)), error
            return
        assert with_history, "a folder of checkpoints with no history was planned"
        if plan is None:
            event("None")
            assert not complete and not damaged_steps
            return
        event(f"resumes {'a step' if plan.candidates else 'nothing'}, passes over "
              f"{len(plan.passed_over)}")
        newest = plan.candidates[0] if plan.candidates else -1
        assert set(plan.candidates) <= set(complete)
        assert plan.candidates == tuple(sorted(plan.candidates, reverse=True))
        assert [line.split(": ")[0] for line in plan.passed_over] == [
            f"step{s}" for s in sorted(damaged_steps) if s > newest]


@at_most(60)
@given(older=st.lists(st.integers(0, 39), max_size=4, unique=True).flatmap(
    lambda steps: st.tuples(*[st.tuples(st.just(s), step_manifest(s),
                                        st.sampled_from(["L", "M"])) for s in steps])),
    latest=st.none() | st.binary(max_size=12))
def test_a_damaged_older_checkpoint_never_stops_the_newest_good_one_from_resuming(older, latest):
    """resume.plan_resume("auto") with a good newest checkpoint of the run and, older, any mix
    of damaged, mutated, incomplete and other runs' checkpoints (`latest` random): it resumes
    the newest one, on its own layout, passing nothing over."""
    with tempfile.TemporaryDirectory() as out:
        directory = os.path.join(out, "checkpoints")
        plant(directory, {s: what for s, what, _ in older}, {s: who for s, _, who in older},
              latest)
        good_checkpoint(directory, 40, "L")
        begun(out)
        plan = plan_resume(out)
        event(f"{len(older)} older, {len(plan.candidates)} candidates")
        assert plan is not None and plan.candidates[0] == 40 and plan.tag == "step40"
        assert plan.resharding is None and plan.passed_over == ()
        assert not plan.by_hand


# --- deeply nested JSON ------------------------------------------------------------------------

def nested(depth: int) -> dict:
    value = {}
    for _ in range(depth):
        value = {"a": value}
    return value


DEEP = b"[" * 5000 + b"]" * 5000  # 10 KB of valid JSON, nested deeper than json's recursion


def deep_manifest(tmp):
    step_dir = os.path.join(tmp, "step8")
    os.makedirs(step_dir)
    write_bytes(os.path.join(step_dir, manifest.MANIFEST), DEEP)
    with pytest.raises(ValueError, match=re.escape(os.path.join(step_dir, manifest.MANIFEST))):
        manifest.read(step_dir)


def deep_checkpoints(directory):
    """step4, good; step8, whose manifest nests too deep."""
    good_checkpoint(directory, 4)
    os.makedirs(os.path.join(directory, "step8"))
    write_bytes(os.path.join(directory, "step8", manifest.MANIFEST), DEEP)


def deep_survey(tmp):
    deep_checkpoints(tmp)
    complete, damaged_steps = folder.survey(tmp)
    assert sorted(complete) == [4] and sorted(damaged_steps) == [8]


def deep_run_description(tmp):
    write_bytes(os.path.join(tmp, folder_description.FILE), DEEP)
    assert folder_description.lineage(tmp) is None
    with pytest.raises(ValueError, match="run.json: not readable as a run description"):
        folder_description.read(tmp)


def deep_run_lock(tmp):
    assert folder_lock.parse_holder(DEEP) is None
    write_bytes(os.path.join(tmp, folder_lock.LOCK_FILE), DEEP)
    assert folder_lock.check(tmp) is None
    with logged_lines() as said:
        RunLock.acquire(tmp).release()
    assert said and said[0].endswith("the lock file is damaged (not a lock record)")


def deep_train_log(tmp):
    log = os.path.join(tmp, "train_log.jsonl")
    write_bytes(log, b'{"step": 1}\n' + DEEP + b"\n")
    assert monitor.keep_log_until(log, 5) == 1
    assert read_bytes(log) == b'{"step": 1}\n'


def deep_plan_resume(tmp):
    deep_checkpoints(os.path.join(tmp, "checkpoints"))
    begun(tmp)
    plan = plan_resume(tmp)
    assert plan.candidates == (4,) and plan.passed_over[0].startswith("step8: ")


def deep_identity(tmp):
    step_dir = os.path.join(tmp, "step8")
    os.makedirs(step_dir)
    write_bytes(os.path.join(step_dir, manifest.MANIFEST),
                encoded({**manifest_record(8), "files": {}, "identity": nested(800)}))
    saved = manifest.read(step_dir)  # parseable: json nests this deep
    lines = same_run.differences(saved["identity"], IDENTITY)
    assert lines and all(isinstance(line, str) for line in lines)


@pytest.mark.parametrize("reader", [deep_manifest, deep_survey, deep_run_description,
                                    deep_run_lock, deep_train_log, deep_plan_resume,
                                    deep_identity], ids=lambda f: f.__name__[5:])
def test_json_nested_too_deep_to_parse_is_damage_not_a_crash(reader, tmp_path):
    """A file of valid JSON nested deeper than Python's json parses (RecursionError, not a
    ValueError) is damage like any other: manifest.read's ValueError, survey's damaged entry,
    run.json's damage, a damaged run.lock taken over, a log line moved; and an identity nested
    as deep as json does parse still gives its lines."""
    reader(str(tmp_path))


def test_a_kept_last_entry_without_its_newline_gets_one(tmp_path):
    """monitor.keep_log_until on a log whose last entry lost its newline (and no line to move):
    the log ends with a newline afterwards, so that the next entry appended (Monitor.scalars)
    starts a line of its own instead of joining this one into a line that is no entry."""
    log = tmp_path / "train_log.jsonl"
    log.write_bytes(b'{"step": 1}\n{"step": 2}')
    monitor.keep_log_until(str(log), 5)
    assert log.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
