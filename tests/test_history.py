"""The decision of where a start goes on from (checkpoint/history.py's `decide`), tested as a state
machine (issue 65, item 6).

`RunFolder` is a run folder in memory (its step folders, what is set aside, which checkpoints' files
no longer verify) with the real OUT/history.jsonl (history.append and history.read, in a folder of
its own per example) and the flags a job's script repeats at every requeue. Its rules are what
happens to a run: a start (the shell around `decide` mirrored from resume.plan_resume and
resume.choose, killed in its append or not), training and a save (save.py's order:
the folder in the way set aside, the manifest, `committed`, `retired` then removal; killed at any
of these), losing or damaging any file, setting a folder aside by hand, changing the layout, the
job's script given `--resume-from`/`--fresh-start`, and the user running the exact command a
refusal or a note suggests. After each start it checks:

  (a) the start is never older than the newest intact checkpoint the run committed (manifest
      readable, files good, in its step folder, not retired and not given up by consent) unless
      a consent spent by this start gave it up, and that consent had never been spent before
      (a repeated --resume-from or --fresh-start never sends the run back twice);
  (b) nothing is ever deleted but by retention (a folder is in its step folder, set aside,
      removed by retention or lost by a rule), and retention removes only checkpoints older
      than the newest --keep-checkpoints of the run;
  (c) a refused start moved nothing and recorded nothing;
  (d) the history read back is what was appended (a torn last line dropped);
  (e) the command a refusal suggests, run at once on the same folder, is not refused again for
      the same reason.
"""

import dataclasses
import os
import re
import shutil
import tempfile
from typing import Dict, List, Optional

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from logged import logged_lines
from tupe_ds.tools.errors import Refused
from tupe_ds.train.checkpoint import history, manifest

LINEAGE = "L"
MEMORY = "/dev/shm"
# a command a line suggests (not the flags it echoes: "tupe-pretrain: --fresh-start ...: ...")
SUGGESTED = re.compile(r"(?<!tupe-pretrain: )(--resume-from step(\d+)|--fresh-start) "
                       r"--giving-up (\w+)")


APPEND_KILL = st.none() | st.tuples(st.sampled_from(["cut", "zeros"]), st.floats(0, 0.999))
SAVE_KILL = st.none() | st.integers(0, 5) | APPEND_KILL


class Refusal(Exception):
    pass


@dataclasses.dataclass
class Ckpt:
    """A checkpoint as its save wrote it."""
    id: str
    step: int
    layout: int
    made: int  # the model's clock when its manifest was written


@dataclasses.dataclass
class Entry:
    """A stepN folder: complete (its manifest reads), damaged (a manifest that does not read) or
    incomplete (no manifest: a save cut short, ckpt None, or a checkpoint that lost its
    manifest)."""
    state: str
    ckpt: Optional[Ckpt]


@dataclasses.dataclass
class Job:
    step: int
    layout: int


class RunFolder(RuleBasedStateMachine):
    """One run folder through a random history of starts, saves, kills and damage."""

    def __init__(self):
        super().__init__()
        # fsync is what an append costs: on a memory filesystem where there is one
        self.out = tempfile.mkdtemp(prefix="history-", dir=MEMORY if os.path.isdir(MEMORY)
                                    else None)
        self.folders: Dict[int, Entry] = {}
        self.aside: List[Entry] = []
        self.bad = set()  # ids whose files do not verify
        self.expected: Optional[list] = None  # the history as appended (None: no file)
        self.damaged_history = False
        self.script = history.Flags()
        self.layout = 0
        self.keep = 3
        self.job: Optional[Job] = None
        self.clock = 0
        self.ids = 0
        # what happened, whatever the files say now
        self.made: Dict[str, Ckpt] = {}
        self.retired = set()  # ids a durable `retired` record names
        self.removed = set()  # ids retention removed
        self.lost = set()  # ids a rule lost
        self.spent: List[dict] = []  # consents durably recorded, with the clock then
        self.given_up = set()
        self.suggestions: List[str] = []
        self.last_refusal: Optional[str] = None
        self.starts = self.refusals = 0
        self.log: List[str] = []

    def teardown(self):
        shutil.rmtree(self.out, ignore_errors=True)

    # --- the files ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return os.path.join(self.out, history.FILE)

    def read(self) -> Optional[list]:
        return history.read(self.out)

    def append(self, records: list, new: list, kill=None) -> list:
        """history.append, then, for `kill` ((how, fraction)), the append cut short by a kill
        (`cut`) or a power loss (`zeros`: what was not written reads as zeros): returns the new
        records that are durable."""
        before = len(records)
        history.append(self.out, records, new)
        self.expected = list(records)
        self.clock += 1
        if kill is None:
            return records[before:]
        how, fraction = kill
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")[:-1]
        batch = lines[len(lines) - len(new):]
        # where the kill cuts, counted in lines: which records survive must not depend on their
        # lengths, which their times ("time": time.time()) change from run to run (Hypothesis
        # replays an example and finds other records durable: FlakyStrategyDefinition)
        whole, part = divmod(fraction * len(batch), 1)
        whole = int(whole)
        at = len(data) - sum(len(line) + 1 for line in batch[whole:])
        offset = at + int(part * len(batch[whole]))  # within its line, never its newline
        if how == "cut":
            data = data[:offset]
        else:
            data = data[:offset] + b"\0" * (len(data) - offset)
        with open(self.path, "wb") as f:
            f.write(data)
        self.expected = records[:before + whole]
        return records[before:before + whole]

    def note_durable(self, durable: list) -> None:
        for item in durable:
            if item["kind"] == "consent":
                self.spent.append({**item, "clock": self.clock})
                if item["outcome"] == "applied":
                    self.given_up.update(item["gives_up"])
            elif item["kind"] == "retired":
                self.retired.add(item["id"])

    def listing(self) -> tuple:
        return tuple(history.Folder(s, e.ckpt.id, LINEAGE) if e.state == "complete" else
                     history.Folder(s) for s, e in sorted(self.folders.items()))

    def snapshot(self):
        data = open(self.path, "rb").read() if os.path.exists(self.path) else None
        return (data, {s: (e.state, e.ckpt and e.ckpt.id) for s, e in self.folders.items()},
                [(e.state, e.ckpt and e.ckpt.id) for e in self.aside])

    def new_ckpt(self, step: int) -> Ckpt:
        self.ids += 1
        return Ckpt(f"c{self.ids:03d}s{step}", step, self.job.layout, self.clock)

    # --- the start: resume.plan_resume and resume.choose, mirrored ---------------------------

    def plan(self, flags: history.Flags) -> Optional[dict]:
        try:
            records = self.read() or []
        except history.HistoryDamaged as error:
            raise Refusal(str(error)) from None
        complete = [e.ckpt for s, e in sorted(self.folders.items()) if e.state == "complete"]
        if not records and (self.folders or self.aside):  # resume.refuse_without_history
            newest_id = complete[-1].id if complete else None
            if not ((flags.resume_from is not None or flags.fresh_start)
                    and flags.giving_up == newest_id):
                raise Refusal("no history: " + (
                    f"--resume-from step{complete[-1].step} --giving-up {newest_id}"
                    if complete else "--fresh-start"))
        live = history.live(records)
        decision = history.decide(records, self.listing(), flags, LINEAGE)
        if decision.refusal:
            raise Refusal(" ".join([*decision.notes, decision.refusal]))
        candidates = decision.candidates
        newest = candidates[0] if candidates else -1
        passed_over = [s for s, e in self.folders.items() if e.state == "damaged" and s > newest]
        plan = {"candidates": candidates, "by_hand": decision.by_hand,
                "fresh_start": decision.fresh_start, "records": list(records),
                "appends": list(decision.appends), "notes": list(decision.notes),
                "passed_over": passed_over}
        if not candidates:
            if not passed_over and not live:
                return plan if plan["appends"] or plan["fresh_start"] or plan["notes"] else None
            if decision.fresh_start is None:
                raise Refusal(" ".join([*decision.notes, self.none_resumable(
                    live[-1].id if live else "none")]))
            return plan
        if self.folders[candidates[0]].ckpt.layout != self.layout:
            raise Refusal(f"layout: step{candidates[0]} was written by layout "
                          f"{self.folders[candidates[0]].ckpt.layout}")
        return plan

    @staticmethod
    def none_resumable(newest_id: str) -> str:
        return f"none can be resumed; to start over, add --fresh-start --giving-up {newest_id}"

    def choose(self, plan: Optional[dict], kill) -> Optional[Ckpt]:
        attempt = history.record("attempt", lineage=LINEAGE, settings={}, sources={})
        if plan is None:
            try:
                records = self.read() or []
            except history.HistoryDamaged as error:  # not reached: the plan read it
                raise Refusal(str(error)) from None
            self.note_durable(self.append(records, [attempt], kill))
            return None
        failed, chosen = [], None
        before = history.live([*plan["records"], *(r for r in plan["appends"]
                                                    if r["kind"] != "consent")])
        for step in plan["candidates"]:
            ckpt = self.folders[step].ckpt
            if ckpt.id not in self.bad:
                if failed and ckpt.layout != self.layout:
                    raise Refusal(f"falling back to step{step}: layout {ckpt.layout}")
                chosen = ckpt
                break
            failed.append(step)
            if plan["by_hand"]:
                raise Refusal(f"--resume-from step{step}: the checkpoint does not verify; where "
                              f"none does, --fresh-start --giving-up {before[-1].id}")
        newest = history.live([*plan["records"], *plan["appends"]])
        newest_id = newest[-1].id if newest else "none"
        if chosen is None and plan["candidates"] and not plan["fresh_start"]:
            raise Refusal(self.none_resumable(newest_id))
        keep_from = chosen.step if chosen else -1
        newer = [s for s in sorted(self.folders) if s > keep_from]
        committed = {c.step: c.id for c in newest}
        moved = [history.record("set_aside", step=s, why="newer",
                                id=self.folders[s].ckpt.id
                                if self.folders[s].state == "complete" else committed.get(s))
                 for s in newer]
        records, new = list(plan["records"]), [*plan["appends"], attempt]
        if plan["fresh_start"]:
            live = [c.id for c in history.live([*records, *new])]
            taken = chosen is None and bool(plan["candidates"] or plan["passed_over"] or moved
                                            or live)
            new.append({**plan["fresh_start"], "outcome": "applied" if taken else "not taken",
                        "gives_up": live if taken else []})
        durable = self.append(records, [*new, *moved], kill)
        self.note_durable(durable)
        if kill is not None:
            return None
        for s in newer:
            self.aside.append(self.folders.pop(s))
        self.clock += 1
        return chosen

    # --- what is intact, and the checks of a start ------------------------------------------

    def intact(self) -> List[Ckpt]:
        return [e.ckpt for s, e in sorted(self.folders.items())
                if e.state == "complete" and e.ckpt.id not in self.bad
                and e.ckpt.id not in self.retired and e.ckpt.id not in self.given_up]

    def check_start(self, intact: List[Ckpt], chosen: Optional[Ckpt], spent_before: List[dict],
                    spent_now: List[dict], flags: history.Flags) -> None:
        back = [c for c in intact if chosen is None or c.step > chosen.step]
        if not back:
            return
        applied = [c for c in spent_now if c["outcome"] == "applied"]
        where = f"step{chosen.step}" if chosen else "step 0"
        assert applied, (f"(a) the start went back to {where} past the intact "
                         f"{[c.id for c in back]} without consent")
        consent = applied[0]
        missing = [c.id for c in back if c.id not in consent["gives_up"]]
        assert not missing, f"(a) {where} gives up {missing}, which its consent does not name"
        again = [c for c in spent_before if c["flag"] == consent["flag"] and (
            flags.giving_up is None or c["given_on"] == flags.giving_up)]
        assert not again, (f"(a) {consent['flag']} sent the run back twice: spent before on "
                           f"{again[0]['given_on']}, now gives up {[c.id for c in back]}")

    def start_with(self, flags: history.Flags, kill=None) -> Optional[str]:
        """A start of the job with these flags; returns its refusal (None: it started)."""
        self.starts += 1
        before = self.snapshot()
        intact = self.intact()
        spent_before = list(self.spent)
        self.job = None  # a requeue: the job before it has ended
        try:
            plan = self.plan(flags)
            chosen = self.choose(plan, kill)
        except Refusal as refusal:
            self.refusals += 1
            assert self.snapshot() == before, "(c) a refused start moved or recorded something"
            self.note(str(refusal))
            self.last_refusal = str(refusal)
            return str(refusal)
        self.last_refusal = None
        self.note(" ".join(plan["notes"]) if plan else "")
        spent_now = self.spent[len(spent_before):]
        if kill is None:
            self.check_start(intact, chosen, spent_before, spent_now, flags)
            self.job = Job(chosen.step if chosen else 0, self.layout)
        return None

    def note(self, text: str) -> None:
        self.suggestions = [m.group(0) for m in SUGGESTED.finditer(text)]

    # --- the rules ---------------------------------------------------------------------------

    @initialize(keep=st.integers(1, 3))
    def begin(self, keep):
        self.keep = keep

    @rule(saves=st.lists(st.integers(1, 3), max_size=4), kill=APPEND_KILL, last=SAVE_KILL)
    def run_job(self, saves, kill, last):
        """A (re)queued job: its start, with the flags its script repeats (killed in its append:
        `kill`), then `saves` checkpoints every few steps, then one more cut short by `last`."""
        self.log.append(f"start {self.script} kill={kill}")
        self.start_with(self.script, kill)
        for k in saves:
            if self.job is not None:
                self.save(k, None)
        if self.job is not None and last is not None:
            self.save(saves[-1] if saves else 1, last)

    @precondition(lambda self: self.job is not None)
    @rule(k=st.integers(1, 3), kill=SAVE_KILL)
    def save(self, k, kill):
        """save.py's phases; `kill`: 0 before anything, 1 with its files half written, 2 with
        the manifest written, its record not, 3 committed, retirement not recorded, 4 retired
        records written, folders not removed, 5 done but for nothing; a tuple: killed in the
        append of `committed`."""
        step = self.job.step + k
        self.log.append(f"save step{step} kill={kill}")
        try:
            if step in self.folders:  # in the way: recorded (when its manifest reads), moved
                entry = self.folders[step]
                if entry.state == "complete":
                    self.note_durable(self.append(self.history_for_save(), [history.record(
                        "set_aside", step=step, why="in the way", id=entry.ckpt.id)]))
                self.aside.append(self.folders.pop(step))
            if kill == 0:
                self.job = None
                return
            self.folders[step] = Entry("incomplete", None)
            if kill == 1:
                self.job = None
                return
            self.history_for_save()  # before the manifest
            ckpt = self.new_ckpt(step)
            self.folders[step] = Entry("complete", ckpt)
            self.made[ckpt.id] = ckpt
            if kill == 2:
                self.job = None
                return
            self.note_durable(self.append(self.history_for_save(), [history.record(
                "committed", id=ckpt.id, step=step, lineage=LINEAGE, files={})],
                kill if isinstance(kill, tuple) else None))
            if isinstance(kill, tuple) or kill == 3:
                self.job = None
                return
            older = sorted(s for s, e in self.folders.items() if e.state == "complete" and s < step)
            removed = older[:max(len(older) - (self.keep - 1), 0)]
            newer_kept = [s for s, e in self.folders.items() if e.state == "complete" and
                          s >= step]
            if removed:
                self.note_durable(self.append(self.history_for_save(), [history.record(
                    "retired", id=self.folders[s].ckpt.id, step=s) for s in removed]))
            if kill == 4:
                self.job = None
                return
            for s in removed:
                assert len([t for t in older if t > s]) + len(newer_kept) >= self.keep, \
                    "(b) retention removed one of the newest kept"
                self.removed.add(self.folders.pop(s).ckpt.id)
            self.clock += 1
            self.job.step = step
            if kill == 5:
                self.job = None
        except history.HistoryDamaged:  # save.py: the record's read raises; the job stops
            self.job = None

    def history_for_save(self) -> list:
        """save.py's `recorded`: the history, else HistoryDamaged (lost while the job ran)."""
        records = self.read()
        if not records:
            raise history.HistoryDamaged("gone while the run trains")
        return records

    @rule(data=st.data())
    def requeue_script(self, data):
        """The job's script is given flags, repeated at every requeue from now on, and maybe
        another layout (a checkpoint of the other one does not load: a refusal)."""
        steps = sorted({*self.folders, *(c.step for c in self.made.values()), 1})
        self.layout = data.draw(st.sampled_from([self.layout, 1 - self.layout]))
        self.script = data.draw(st.sampled_from([
            history.Flags(),
            history.Flags(resume_from=data.draw(st.sampled_from(sorted(self.folders) or steps)
                                                | st.sampled_from(steps))),
            history.Flags(fresh_start=True)]))
        self.log.append(f"script {self.script}, layout {self.layout}")

    @precondition(lambda self: self.suggestions)
    @rule(data=st.data())
    def follow_suggestion(self, data):
        """The user puts the exact command a refusal or a note suggests into the script, and
        the job starts at once."""
        text = data.draw(st.sampled_from(self.suggestions))
        match = SUGGESTED.fullmatch(text)
        refused = self.last_refusal
        self.script = history.Flags(
            resume_from=int(match.group(2)) if match.group(2) else None,
            fresh_start=match.group(2) is None, giving_up=match.group(3))
        self.log.append(f"follow {text}")
        again = self.start_with(self.script)
        assert again is None or refused is None or again != refused, \
            f"(e) the command the refusal suggested ({text}) is refused the same way: {again}"

    @precondition(lambda self: self.folders)
    @rule(data=st.data(), how=st.sampled_from(["lose", "manifest", "lose manifest", "files",
                                               "mend", "aside"]))
    def harm(self, data, how):
        """A step folder lost, its manifest damaged or lost, its files damaged (or restored by
        the user), or set aside by hand."""
        step = data.draw(st.sampled_from(sorted(self.folders)))
        entry = self.folders[step]
        self.log.append(f"{how} step{step}")
        if how == "lose":
            del self.folders[step]
            if entry.ckpt:
                self.lost.add(entry.ckpt.id)
        elif how == "manifest" and entry.state == "complete":
            entry.state = "damaged"
        elif how == "lose manifest" and entry.state != "incomplete":
            entry.state = "incomplete"
        elif how == "files" and entry.ckpt:
            self.bad.add(entry.ckpt.id)
        elif how == "mend" and entry.ckpt:
            self.bad.discard(entry.ckpt.id)
        elif how == "aside":
            self.aside.append(self.folders.pop(step))

    @precondition(lambda self: self.aside)
    @rule(data=st.data())
    def lose_set_aside(self, data):
        index = data.draw(st.integers(0, len(self.aside) - 1))
        entry = self.aside.pop(index)
        self.log.append(f"lose set-aside {entry.ckpt and entry.ckpt.id}")
        if entry.ckpt:
            self.lost.add(entry.ckpt.id)

    @precondition(lambda self: self.expected is not None or self.damaged_history)
    @rule()
    def lose_history(self):
        self.log.append("lose history")
        os.remove(self.path)
        self.expected, self.damaged_history = None, False

    @precondition(lambda self: self.expected is not None and len(self.expected) >= 2)
    @rule(data=st.data())
    def damage_history(self, data):
        """A line other than the last changed: every start refuses (HistoryDamaged)."""
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        number = data.draw(st.integers(0, len(self.expected) - 2))
        lines[number] = lines[number].replace(b'"kind"', b'"kimd"')
        with open(self.path, "wb") as f:
            f.write(b"\n".join(lines))
        self.log.append(f"damage history line {number + 1}")
        self.damaged_history, self.expected = True, None

    @precondition(lambda self: self.damaged_history)
    @rule()
    def move_damaged_history_aside(self):
        """What HistoryDamaged says to do (once a start said it: the job has ended)."""
        os.replace(self.path, self.path + ".damaged")
        self.log.append("mv history.jsonl history.jsonl.damaged")
        self.damaged_history = False

    @precondition(lambda self: self.expected)
    @rule()
    def power_loss_after_append(self):
        """A power loss that leaves the last line whole but not what was written (its blocks
        never reached the disk): read drops it as torn."""
        with open(self.path, "rb") as f:
            data = f.read()
        # else the last line is torn or garbled already, not a record
        whole = data.endswith(b"\n") and len(history.parsed(data, self.path)[0]) == data.count(
            b"\n")
        if not whole:
            return
        body = data[:-1]
        cut = body.rfind(b"\n") + 1
        with open(self.path, "wb") as f:
            f.write(body[:cut] + b"\0" * (len(body) - cut) + b"\n")
        self.log.append("power loss: last line zeros")
        self.expected = self.expected[:-1]
        self.job = None

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def history_reads_back(self):
        """(d)"""
        if self.damaged_history:
            with pytest.raises(history.HistoryDamaged):
                self.read()
            return
        assert self.read() == self.expected, "(d) the history read back is not what was appended"

    @invariant()
    def nothing_deleted(self):
        """(b): every checkpoint made is in a step folder, set aside, removed by retention (after
        its `retired` record), or lost by a rule."""
        here = {e.ckpt.id for e in [*self.folders.values(), *self.aside] if e.ckpt}
        for id_ in self.made:
            assert (id_ in here) + (id_ in self.removed) + (id_ in self.lost and id_ not in here) \
                == 1, f"(b) {id_} is gone"
        assert self.removed <= self.retired, "(b) removed without a retired record"


def run_machine(machine_class, examples: int):
    state = machine_class.TestCase
    state.settings = settings(max_examples=examples, stateful_step_count=25, deadline=None,
                              suppress_health_check=list(HealthCheck))
    state().runTest()


@pytest.mark.slow
def test_random_histories():
    run_machine(RunFolder, 300)


# --- the cases, on real folders: resume.plan_resume and resume.choose as they are -------

LAYOUT = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "zero_stage": 2, "micro_batch": 8,
          "gradient_accumulation": 1, "vocab_size": 1024}


@pytest.fixture(scope="module")
def one_process():
    """A one-process gloo group for choose's collectives (destroyed after, if made here)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def saved(out, step: int) -> str:
    """A checkpoint committed as save.py commits one: its file, the manifest, the `committed`
    record; its id."""

    step_dir = os.path.join(out, "checkpoints", f"step{step}")
    os.makedirs(step_dir)
    with open(os.path.join(step_dir, "state.json"), "w") as f:
        f.write('{"step": %d}' % step)
    identity = history.new_id()
    files = manifest.describe(step_dir, ["state.json"])
    manifest.write(step_dir, {"tag": f"step{step}", "step": step, "id": identity,
                              "lineage": LINEAGE, "identity": {}, "layout": LAYOUT,
                              "files": files})
    history.append(out, history.read(out) or [], [history.record(
        "committed", id=identity, step=step, lineage=LINEAGE, files=files)])
    return identity


def damage_files(out, step: int) -> None:
    with open(os.path.join(out, "checkpoints", f"step{step}", "state.json"), "r+") as f:
        f.write("X")


def started(out, resume_from=None, fresh_start=False, giving_up=None):
    """A start as tupe-pretrain makes it (plan_resume, then choose on every rank, which records
    it): (the step resumed, 0 for step 0, or the refusal; what it said)."""
    from tupe_ds.train.checkpoint import resume

    with logged_lines() as said:
        try:
            plan = resume.plan_resume(out, "auto", resume_from, 1, 1, 1, 2,
                                      fresh_start=fresh_start, giving_up=giving_up)
            chosen = resume.choose(plan, 1, 1, 1, 2,
                                   (out, history.attempt_fields(LINEAGE, {}, {})))
        except (ValueError, Refused) as refusal:
            return str(refusal), said
    return (int(chosen.tag[4:]) if chosen else 0), said


def everything_in(out) -> list:
    return sorted(os.path.relpath(os.path.join(root, name), out)
                  for root, folders, files in os.walk(out) for name in folders + files)


@pytest.fixture
def out(tmp_path):
    os.makedirs(tmp_path / "run" / "checkpoints")
    return str(tmp_path / "run")


def test_resume_from_repeated_after_the_history_is_lost_is_not_applied_twice(out, one_process):
    """The job's script says --resume-from step2 at every requeue: it sends the run back once;
    with the history lost, the start is refused (nothing moved) until a consent names the
    newest checkpoint there."""
    assert started(out)[0] == 0
    saved(out, 2), saved(out, 4)
    assert started(out, resume_from="step2")[0] == 2  # step4 set aside
    saved(out, 3)
    newest = saved(out, 5)
    os.remove(os.path.join(out, history.FILE))
    before = everything_in(out)
    refusal, _ = started(out, resume_from="step2")
    assert isinstance(refusal, str) and "history.jsonl is not there" in refusal, refusal
    assert f"--resume-from step5 --giving-up {newest}" in refusal
    assert everything_in(out) == before
    assert started(out, resume_from="step5", giving_up=newest)[0] == 5


def test_a_same_numbered_set_aside_folder_does_not_hide_the_loss_of_the_newest(out, one_process):
    saved(out, 2), saved(out, 4)
    assert started(out, resume_from="step2")[0] == 2  # this step4 set aside
    saved(out, 3)
    newest = saved(out, 4)  # another step4
    shutil.rmtree(os.path.join(out, "checkpoints", "step4"))
    before = everything_in(out)
    refusal, _ = started(out, resume_from="step2")
    assert isinstance(refusal, str) and f"step4 as committed (id {newest})" in refusal, refusal
    assert f"--resume-from step3 --giving-up {newest}" in refusal
    assert everything_in(out) == before
    assert started(out, resume_from="step3", giving_up=newest)[0] == 3


def test_fresh_start_given_on_good_checkpoints_is_spent_not_kept_for_later_damage(out,
                                                                                one_process):
    saved(out, 2), saved(out, 4)
    step, said = started(out, fresh_start=True)
    assert step == 4 and any("--fresh-start not taken" in line for line in said), said
    assert [r["outcome"] for r in history.read(out) if r["kind"] == "consent"] == ["not taken"]
    newest = saved(out, 6)  # the job trains on
    for step in (2, 4, 6):
        damage_files(out, step)
    before = everything_in(out)
    refusal, said = started(out, fresh_start=True)  # the script repeats it
    assert isinstance(refusal, str) and f"--fresh-start --giving-up {newest}" in refusal, refusal
    assert any("--fresh-start was spent" in line for line in said), said
    assert everything_in(out) == before
    assert started(out, fresh_start=True, giving_up=newest)[0] == 0  # that exact command
    assert os.listdir(os.path.join(out, "checkpoints")) == ["set-aside"]


def test_a_torn_last_line_is_ignored_and_a_damaged_middle_line_refuses(out, one_process):
    saved(out, 2), saved(out, 4)
    path = os.path.join(out, history.FILE)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-20])  # a kill in the append of step4's `committed`
    assert [r["step"] for r in history.read(out) if r["kind"] == "committed"] == [2]
    assert started(out)[0] == 4  # its manifest was written: adopted
    lines = open(path, "rb").read().split(b"\n")
    assert len(lines) == 4 and b'"step": 2' in lines[0]  # committed, adopted, attempt, b""
    lines[0] = lines[0].replace(b'"step": 2', b'"step": 3')
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    before = everything_in(out)
    with pytest.raises(history.HistoryDamaged, match=r"line 1: its checksum differs .* move the "
                       r"file aside \(mv .*history.jsonl .*history.jsonl.damaged\)"):
        history.read(out)
    refusal, _ = started(out)
    assert "history.jsonl.damaged" in refusal and everything_in(out) == before
    os.replace(path, path + ".damaged")
    newest = history.checkpoint_id(manifest.read(os.path.join(out, "checkpoints", "step4")))
    before = everything_in(out)
    refusal, _ = started(out)  # what the folder holds is not guessed around: named
    assert f"--resume-from step4 --giving-up {newest}" in refusal and everything_in(out) == before
    assert started(out, resume_from="step4", giving_up=newest)[0] == 4


# --- what the machine found (issue 65, item 6): each fails as history.py and resume.py are ------

def test_fresh_start_giving_up_a_lost_checkpoint_is_taken(out, one_process):
    saved(out, 2)
    shutil.rmtree(os.path.join(out, "checkpoints", "step2"))
    newest = history.live(history.read(out))[-1].id
    refusal, _ = started(out)
    assert f"--fresh-start --giving-up {newest}" in refusal
    assert started(out, fresh_start=True, giving_up=newest)[0] == 0
    assert started(out, fresh_start=True, giving_up=newest)[0] == 0  # the script repeats it


def test_the_command_a_refusal_suggests_proceeds_after_a_fresh_start_not_taken(out,
                                                                               one_process):
    saved(out, 2)
    newest = saved(out, 4)
    assert started(out, fresh_start=True)[0] == 4  # not taken; killed before its next save
    for step in (2, 4):
        damage_files(out, step)
    refusal, _ = started(out, fresh_start=True)
    assert f"--fresh-start --giving-up {newest}" in refusal
    assert started(out, fresh_start=True, giving_up=newest)[0] == 0


def test_a_history_of_one_torn_line_is_a_lost_one(out, one_process):
    saved(out, 2), saved(out, 4)
    assert started(out, resume_from="step2")[0] == 2
    newest = saved(out, 3)
    path = os.path.join(out, history.FILE)
    with open(path, "rb") as f:
        first = f.read().split(b"\n")[0]
    with open(path, "wb") as f:  # lost, then a start killed in its append
        f.write(first[:40])
    assert history.read(out) == []
    refusal, said = started(out, resume_from="step2")
    assert f"--resume-from step3 --giving-up {newest}" in refusal, said
    assert started(out, resume_from="step3", giving_up=newest)[0] == 3


def test_an_append_after_a_garbled_last_line_keeps_the_history_readable(out):
    saved(out, 2), saved(out, 4)
    path = os.path.join(out, history.FILE)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines[1] = b"\0" * len(lines[1])
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    assert [r["step"] for r in history.read(out)] == [2]
    saved(out, 6)
    assert [r["step"] for r in history.read(out)] == [2, 6]


def test_one_step_set_aside_twice_in_one_second(out, monkeypatch):
    from tupe_ds.train.checkpoint import folder

    now = folder.time.gmtime()
    monkeypatch.setattr(folder.time, "gmtime", lambda *_: now)
    directory = os.path.join(out, "checkpoints")
    for content in ("first", "second"):
        os.makedirs(os.path.join(directory, "step4"))
        with open(os.path.join(directory, "step4", "state.json"), "w") as f:
            f.write(content)
        folder.set_aside(directory, [4], "newer")
    assert not os.path.exists(os.path.join(directory, "step4"))
