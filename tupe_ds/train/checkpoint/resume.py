"""Where a start goes on from: the checkpoint it resumes, planned before any process starts from
the run's history and folder (`plan_resume`), verified by every rank before the engine is built
(`choose`), then loaded (`load_or_initialise`); else the checkpoint a new run starts from
(init_from.py). What a start spent and moved goes into the history before anything moves."""

import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from typing import Dict, List, Optional

import torch.distributed as dist

from tupe_ds.tools.errors import NotRegularFile, Refused
from tupe_ds.train.checkpoint import history, init_from, loading, manifest, reads, reshard
from tupe_ds.train.checkpoint import same_run
from tupe_ds.train.checkpoint.folder import (SET_ASIDE, TAG, set_aside, step_folders, step_of,
                                             survey, tag_of, tags)
from tupe_ds.train.optim import apply_config, rate_from_schedule

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    directory: str  # OUT/checkpoints
    candidates: tuple  # steps, newest first: the one to resume, then the fallbacks
    resharding: Optional[reshard.Reshard]  # how candidates[0] loads on this layout
    by_hand: bool  # --resume-from: that one or none
    passed_over: tuple = ()  # lines: newer step folders not resumed, and why
    notes: tuple = ()  # lines to say
    fresh_start: Optional[dict] = None  # --fresh-start's consent: from step 0 if none verifies
    records: tuple = ()  # the run's history as read
    appends: tuple = ()  # what the start records before it acts: adopted, spent
    lineage: str = ""

    @property
    def tag(self) -> str:
        return tag_of(self.candidates[0])

    @property
    def live(self) -> List[history.Checkpoint]:
        return history.live([*self.records, *self.appends])


def plan_resume(out: str, resume: str, resume_from: Optional[str], world_size: int, tp: int,
                pp: int, zero_stage: int, fresh_start: bool = False,
                giving_up: Optional[str] = None) -> Optional[ResumePlan]:
    """What --out holds to resume (None: nothing); ValueError saying what to do when it cannot
    be resumed (history.decide's refusals, a lost history, another run's checkpoint in the way,
    --resume never over checkpoints, checkpoints of which none reads without --fresh-start)."""
    directory = os.path.join(out, "checkpoints")
    complete, damaged = survey(directory)
    records = history.read(out) or []
    live = history.live(records)
    if resume == "never":
        held = sorted(set(complete) | set(damaged))
        if held or live:
            raise ValueError(
                f"--resume never, and it holds checkpoints of a run ("
                f"{tags(held) or 'its history records ' + tags(c.step for c in live)}): nothing "
                "is overwritten. To continue that run leave out --resume never; to start over "
                "give another --out" + (f"; to start a new run from its weights, --out NEW "
                                        f"--init-from {directory}/{tag_of(held[-1])}" if held
                                        else ""))
        return None
    step = resume_from_step(directory, resume_from) if resume_from is not None else None
    if records:
        refuse_older_history(out, directory, records, max(complete, default=-1))
        lineage = history.lineage(records)
    else:  # the run the consent names
        lineage = refuse_without_history(out, directory, complete, damaged, step,
                                         step is not None or fresh_start, giving_up)
    lineage = lineage or uuid.uuid4().hex
    if live and live[-1].step not in complete:  # the history's newest: a stale listing?
        path = os.path.join(directory, tag_of(live[-1].step), manifest.MANIFEST)
        with contextlib.suppress(FileNotFoundError):  # not there within the retry window
            reads.retried(path, lambda: os.stat(path), expected=True)
            complete, damaged = survey(directory)  # a shared filesystem's listing was stale
    if records and complete and all(m["lineage"] != lineage for m in complete.values()):
        path = os.path.join(out, history.FILE)
        raise ValueError(
            f"{path} is the history of run {lineage}, and {directory} holds only another run's "
            f"checkpoints ({tags(complete)}, lineage "
            f"{', '.join(sorted({m['lineage'] for m in complete.values()}))}). Nothing was moved "
            "or deleted. Put back this folder's own history and run the same command; or, to go "
            f"on with the checkpoints here, move this history aside (mv {path} {path}.other) and "
            "run the same command, which then names the command that goes on from their newest; "
            f"else move them out of {directory}")
    folders = step_folders(directory)
    decision = history.decide(records, tuple(
        history.Folder(s, history.checkpoint_id(complete[s]), complete[s]["lineage"])
        if s in complete else history.Folder(s) for s in folders),
        history.Flags(step, fresh_start, giving_up), lineage)
    if decision.refusal:
        raise ValueError(" ".join([*decision.notes, decision.refusal]))
    candidates = decision.candidates
    newest = candidates[0] if candidates else -1
    foreign = [s for s in complete if complete[s]["lineage"] != lineage and candidates
               and s > newest and not decision.by_hand]
    if foreign:
        raise ValueError(
            f"{directory}/{tag_of(foreign[-1])} is another run's checkpoint (lineage "
            f"{complete[foreign[-1]]['lineage']}; this run's is {lineage}), newer than this "
            f"run's newest, {tag_of(newest)}: move {tags(foreign)} out of {directory}, "
            f"or resume this run's own with --resume-from {tag_of(newest)} (newer "
            "folders are then set aside, not deleted)")
    unmarked = {c.step for c in live} - set(complete) - set(damaged)
    problems = {**damaged, **{s: "no manifest.json, though the run's history records it "
                              "committed" for s in unmarked if s in folders}}
    plan = ResumePlan(
        directory, candidates, plan_layout(directory, newest, world_size, tp, pp, zero_stage)
        if candidates else None, decision.by_hand, tuple(
            f"{tag_of(s)}: {problem}" for s, problem in sorted(problems.items()) if s > newest),
        decision.notes, decision.fresh_start, tuple(records), decision.appends, lineage)
    if candidates or decision.fresh_start is not None:
        return plan
    if not plan.passed_over and not live:  # only saves cut short (with no history: refused)
        return plan if plan.appends or plan.notes else None
    raise ValueError(" ".join([*decision.notes, none_resumable(directory, [
        (tag_of(s), damaged.get(s, "no manifest.json (not complete)")) for s in reversed(folders)],
        live)]))


def set_aside_folders(directory: str) -> List[str]:
    """The folders in CHECKPOINTS/set-aside/*/, in order."""
    kept = os.path.join(directory, SET_ASIDE)
    return [os.path.join(kept, when, name) for when in sorted(reads.list_folder(kept))
            for name in sorted(reads.list_folder(os.path.join(kept, when)))]


def refuse_without_history(out: str, directory: str, complete: Dict[int, dict],
                           damaged: Dict[int, str], step: Optional[int], consent: bool,
                           giving_up: Optional[str]) -> Optional[str]:
    """With no history, a folder that holds anything of a run (a step folder, `latest`, a folder
    set aside) is refused unless a consent names the state it is given on: --resume-from or
    --fresh-start with --giving-up the id of the newest complete checkpoint of a run (of the
    one --resume-from names); --fresh-start where none is complete. The history alone tells
    whether a newer checkpoint was committed and lost and which consents were spent, so nothing
    is guessed from the folder; but a consent a job's script kept from an earlier loss does not
    pass over the checkpoint `latest` names lost. The lineage of the run the consent names."""
    held = [name for name in sorted(reads.list_folder(directory))
            if name in ("latest", SET_ASIDE) or TAG.match(name)]
    newest = {m["lineage"]: s for s, m in sorted(complete.items())}  # per run, its newest
    lineage = complete[step]["lineage"] if step in complete else \
        complete[max(complete)]["lineage"] if complete else None
    lost = lost_latest(directory, max(complete, default=-1))
    if not held or consent and giving_up == (history.checkpoint_id(complete[newest[lineage]])
                                             if complete else None) and not lost:
        return lineage  # none complete: a bare --fresh-start
    shown = [name if not TAG.match(name) or step_of(name) in complete else f"{name} (" + (
        f"damaged: {damaged[step_of(name)]})" if step_of(name) in damaged else
        "no manifest.json)") for name in held]
    commands = [f"--resume-from {tag_of(s)} --giving-up {history.checkpoint_id(complete[s])}"
                + (f" (lineage {one})" if len(newest) > 1 else "") for one, s in newest.items()]
    raise ValueError(
        f"{out}/{history.FILE} is not there (or empty), and {directory} holds "
        f"{'; '.join(shown)}" + (f" (its latest names {lost}, which it does not hold)" if lost
                                 else "") + ": the history alone tells whether a newer "
        "checkpoint was committed and lost, and which --resume-from or --fresh-start were spent, "
        "so the run is not guessed from the folder. Nothing was moved or deleted. Put back the "
        "history as it was last written (an older copy of it cannot tell either) and run the "
        "same command; or " + (f"remove {directory}/latest and " if lost else "") + (
            "go on from the newest complete checkpoint deliberately, giving up whatever newer "
            "was lost: " + " or ".join(commands) + " (an older one of the run: --resume-from "
            "stepK with the same --giving-up)" if complete else
            "start this run over from step 0: --fresh-start (what is there is set aside, not "
            "deleted; step folders of a tupe_ds before 2026-11-29, which wrote no manifest, "
            "resume with that version)"))


def refuse_older_history(out: str, directory: str, records: List[dict], newest: int) -> None:
    """ValueError when `latest` names a checkpoint the folder lacks, newer than any the history
    records committed and than the folder's `newest`: a copy of the history older than the
    folder was put back."""
    committed = max([r["step"] for r in records if r["kind"] == "committed"] + [newest])
    if lost := lost_latest(directory, committed):
        raise ValueError(
            f"{out}/{history.FILE} records no checkpoint after {tag_of(committed)}, but "
            f"{directory}/latest names {lost}, which the folder does not hold: is the history an "
            "older copy, put back? Nothing was moved or deleted. Put back the history as it was "
            f"last written and run the same command; or, to go on from what this history "
            f"records, giving up {lost}, remove {directory}/latest and run the same command")


def lost_latest(directory: str, newest: int) -> Optional[str]:
    """The stepN `latest` names (each commit writes it) when the folder lacks it: newer than
    `newest`, no step folder, and no folder of that step set aside after `latest` was written
    (one set aside before it is an older checkpoint of the same step). Both times are the
    filesystem's."""
    path = os.path.join(directory, "latest")
    try:
        named = reads.read_bytes(path, root=directory)[:64].decode(errors="replace").strip()
        written = os.stat(path).st_mtime_ns
        if step_of(named) <= newest or os.path.isdir(os.path.join(directory, named)):
            return None
    except (FileNotFoundError, NotRegularFile, ValueError):  # ValueError: not a step's name
        return None
    if any(os.path.basename(kept) == named and os.stat(os.path.dirname(kept)).st_mtime_ns
           >= written for kept in set_aside_folders(directory)):
        return None
    return named


def resume_from_step(directory: str, resume_from: str) -> int:
    """The step --resume-from names: stepN, or the path of a step folder of --out's."""
    if os.sep in resume_from.rstrip("/") and os.path.realpath(
            os.path.dirname(resume_from.rstrip("/"))) != os.path.realpath(directory):
        raise ValueError(
            f"--resume-from {resume_from} is not a checkpoint of this run folder ({directory}): "
            f"give one of its own (stepN), start a new run from that checkpoint with --init-from "
            f"{resume_from}, or give its run folder as --out")
    try:
        return step_of(os.path.basename(resume_from.rstrip("/")))
    except ValueError as error:
        raise ValueError(f"--resume-from {resume_from}: {error}") from None


def none_resumable(directory: str, found, live: List[history.Checkpoint]) -> str:
    """The refusal of a start from step 0 over checkpoints (`found`: (stepN, why not) each;
    `live`: the history's)."""
    fresh = fresh_start_command(live)
    if not found:
        return (f"{directory} holds no checkpoint, though the run's history records "
                f"{tags(c.step for c in live)} as committed (were they moved?). Nothing was moved "
                "or deleted. Put them back and run the same command; or, to start this run over "
                f"from step 0, add {fresh}")
    return (f"{directory} holds checkpoints of which none can be resumed: "
            + "; ".join(f"{tag}: {why}" for tag, why in found)
            + ". Nothing was moved or deleted. Mend them (restore their files) and run the same "
            f"command; or, to start this run over from step 0, add {fresh} (they are then "
            f"set aside in {os.path.join(directory, SET_ASIDE)}, not deleted)")


def fresh_start_command(live: List[history.Checkpoint]) -> str:
    return "--fresh-start" + (f" --giving-up {live[-1].id}" if live else "")


def plan_layout(directory: str, step: int, world_size: int, tp: int, pp: int,
                zero_stage: int) -> Optional[reshard.Reshard]:
    """How checkpoint `step` loads on this layout (reshard.plan)."""
    step_dir = os.path.join(directory, tag_of(step))
    return reshard.plan(tag_of(step), reshard.saved_layout(manifest.read(step_dir)), world_size,
                        tp, pp, zero_stage, reshard.has_zero_shards(step_dir))


def what_is_where(out: str, plan: Optional[ResumePlan], init_plan=None) -> List[str]:
    """tupe-pretrain --check-only: each step folder and folder set aside, and where a run would
    start from (`init_plan`: --init-from's, where there is nothing to resume)."""
    directory = os.path.join(out, "checkpoints")
    complete, damaged = survey(directory)
    lines = [f"{path}: " + (f"complete (lineage {complete[s]['lineage']})" if s in complete
                            else f"damaged ({damaged[s]})" if s in damaged
                            else "not a folder" if not os.path.isdir(path)
                            else "incomplete (no manifest.json: a save cut short)")
             for s, path in ((s, os.path.join(directory, tag_of(s)))
                             for s in step_folders(directory))]
    lines += [f"{kept}: set aside (never resumed from, never deleted by tupe_ds)"
              for kept in set_aside_folders(directory)]
    lines = lines or [f"{directory}: no checkpoint"]
    if plan is not None and plan.candidates:
        lines.append(f"a run would resume {plan.tag} once its files verify; else, in turn: "
                     + ", ".join([*([] if plan.by_hand else map(tag_of, plan.candidates[1:])),
                                  "step 0 (--fresh-start)" if plan.fresh_start
                                  and not plan.by_hand else "a refusal, with nothing moved"]))
        newer = [s for s in step_folders(directory) if s > plan.candidates[0]]
        if newer:
            lines.append(f"resuming {plan.tag}, it would set aside {tags(newer)} (into "
                         f"{os.path.join(directory, SET_ASIDE)}, not deleted)")
    elif init_plan is not None:
        lines.append((f"a run would branch from {init_plan.step_dir} at step {init_plan.step}"
                      if init_plan.branch else f"a run would start from step 0 with the weights "
                      f"of {init_plan.step_dir}" + (" and its optimizer state"
                                                    if init_plan.with_optimizer else ""))
                     + " once its files verify")
    else:
        lines.append("a run would start from step 0" + (
            ", setting the damaged checkpoints aside (--fresh-start)" if plan and plan.fresh_start
            and (plan.passed_over or plan.live) else ""))
    return lines


# --- every rank, before the engine is built ------------------------------------------------------

def agree_with_rank_0(plan: Optional[ResumePlan]) -> Optional[ResumePlan]:
    """Collective: rank 0's plan, once every rank sees the manifests of its candidates as rank 0
    does; Refused naming the ranks that do not (--out not shared, or files late)."""
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    plan = shared[0]

    def seen():  # (step, the digest of its manifest, or None where it is not seen)
        view = []
        for step in plan.candidates if plan else ():
            try:
                view.append((step, manifest.digest(os.path.join(plan.directory, tag_of(step)))))
            except (FileNotFoundError, NotRegularFile):
                view.append((step, None))
        return socket.gethostname(), tuple(view)

    views = reads.gathered(seen, "every rank to read the manifests of the checkpoints rank 0 chose")
    differing = [f"rank {rank} on {host} sees " + ", ".join(
        f"{tag_of(step)} {'otherwise' if digest else 'not at all'}"
        for (step, digest), (_, theirs) in zip(view, views[0][1]) if digest != theirs)
        for rank, (host, view) in enumerate(views) if view != views[0][1]]
    if differing:
        raise Refused(
            f"the ranks see different checkpoints in {plan.directory}: rank 0 would resume "
            f"{plan.tag}, and {'; '.join(differing)}. Is --out a folder every node shares, the "
            "same for every rank? (Or wait until the filesystem shows every node the same "
            "files, then run the same command.)")
    return plan


def choose(plan: Optional[ResumePlan], world_size: int, tp: int, pp: int, zero_stage: int,
           attempt: Optional[tuple] = None) -> Optional[ResumePlan]:
    """Collective: the first of rank 0's candidates whose files every rank verifies, as a plan
    of its own (None: from step 0); failures said file by file, the step folders newer than the
    one chosen set aside. None verifies: Refused with nothing moved (--resume-from, or without
    --fresh-start), else from step 0. Rank 0 first records in the history this start
    (`attempt`: (OUT, its fields)), what the plan adopted and spent, --fresh-start's
    outcome and the folders it sets aside."""
    plan = agree_with_rank_0(plan)
    if plan is None:
        if attempt is not None:
            out, fields = attempt
            reads.gathered(lambda: None if dist.get_rank() else write_history(
                out, history.read(out) or [], [history.record("attempt", **fields)]),
                "rank 0 to record the start in the run's history")
        return None
    for line in [f"tupe-pretrain: checkpoint {line}: not complete, not resumed"
                 for line in plan.passed_over] + list(plan.notes):
        logger.info(line)
    failed, chosen, live = {}, None, plan.live
    for step in plan.candidates:
        problems = manifest.verify(os.path.join(plan.directory, tag_of(step)))
        if not problems:
            try:
                chosen = plan if not failed else dataclasses.replace(
                    plan, candidates=plan.candidates[len(failed):], resharding=plan_layout(
                        plan.directory, step, world_size, tp, pp, zero_stage))
            except ValueError as error:
                raise Refused(f"falling back to {tag_of(step)}: {error}") from None
            break
        logger.info(f"tupe-pretrain: checkpoint {tag_of(step)} failed verification: "
                    + "; ".join(problems))
        failed[step] = problems
        if plan.by_hand:  # the run as it was before this start's consent gave any up
            before = history.live([*plan.records, *(r for r in plan.appends
                                                     if r["kind"] != "consent")])
            raise Refused(f"--resume-from {tag_of(step)}: the checkpoint does not verify "
                          "(above). Restore its files and run the same command; or choose "
                          "another; or, where none verifies, start this run over from step 0: "
                          + fresh_start_command(before) + " (what is there is set aside, not "
                          "deleted)")
    if chosen is not None and plan.fresh_start:
        logger.info(f"tupe-pretrain: --fresh-start not taken: {chosen.tag} can be resumed (a "
                    "fresh start is only for a folder none of whose checkpoints can; the flag is "
                    "now spent: a later attempt that needs it says so)")
    if chosen is not None and failed:
        logger.info(f"tupe-pretrain: resuming from {chosen.tag}, the previous complete checkpoint")
    elif chosen is None and plan.candidates and not plan.fresh_start:
        raise Refused(none_resumable(plan.directory, [
            (tag_of(step), problems[0] + (f" (and {len(problems) - 1} more, above)"
                                          if len(problems) > 1 else ""))
            for step, problems in sorted(failed.items(), reverse=True)], live))
    elif chosen is None and (plan.candidates or plan.passed_over):
        logger.info(f"tupe-pretrain: no checkpoint of {plan.directory} can be resumed (above): "
                    "starting anew from step 0 (--fresh-start); they are set aside, not deleted")

    def set_aside_newer():
        complete = survey(plan.directory)[0]
        # starting anew, another run's complete checkpoints stay where they are
        newer = [s for s in step_folders(plan.directory) if s > (chosen.candidates[0] if chosen
                                                                 else -1)
                 and (chosen or s not in complete or complete[s]["lineage"] == plan.lineage)]
        committed = {c.step: c.id for c in live}
        moved = [history.record("set_aside", step=s, id=history.checkpoint_id(complete[s])
                                if s in complete else committed.get(s), why="newer than the "
                                "checkpoint resumed" if chosen else "--fresh-start") for s in newer]
        out, fields = attempt or (os.path.dirname(plan.directory), None)
        new = [*plan.appends, *([history.record("attempt", **fields)] if fields else [])]
        if plan.fresh_start:
            taken = chosen is None and bool(plan.candidates or plan.passed_over or moved or live)
            new.append({**plan.fresh_start, "outcome": "applied" if taken else "not taken",
                        "gives_up": [c.id for c in live] if taken else []})
        write_history(out, list(plan.records), [*new, *moved])  # before anything moves
        try:
            said = set_aside(plan.directory, newer, (
                f"newer than {chosen.tag}, the checkpoint resumed" if chosen else
                "none could be resumed, --fresh-start") + ": failed, damaged, incomplete or "
                "left by --resume-from")
        except OSError as error:  # a full disk or quota: the history holds what was decided
            raise reads.Unreadable(
                f"could not set aside {tags(newer)} in {plan.directory} "
                f"({reads.error_text(error)}); nothing was deleted, and the newest intact "
                f"checkpoint is {chosen.tag if chosen else 'none'}: run the same command once "
                "the filesystem lets it (space, quota, or what is in the way)") from None
        if said:
            logger.info(said)

    reads.gathered(set_aside_newer if dist.get_rank() == 0 else lambda: None,
                   "rank 0 to set aside the folders newer than the checkpoint resumed")
    return chosen


def write_history(out: str, records: list, new: list) -> None:
    """Rank 0: history.append; a full disk stops every rank alike, with nothing moved."""
    try:
        history.append(out, records, new)
    except OSError as error:
        raise reads.Unreadable(f"could not write {os.path.join(out, history.FILE)} "
                               f"({reads.error_text(error)}): nothing was moved or deleted; run "
                               "the same command once the filesystem has space") from None


# --- into the engine -----------------------------------------------------------------------------

@dataclasses.dataclass
class Start:
    """What a start goes on from, agreed by every rank before its engine is built."""
    plan: Optional[ResumePlan]  # the checkpoint it resumes (None: none)
    training_changes: list  # lines: how it trains otherwise than that checkpoint
    lineage: str


def agreed(run) -> Start:
    """Collective: the checkpoint the start resumes (choose) with the training changes it makes,
    Refused where it may not make them; or the --init-from checked."""
    lineage = run.resume_plan.lineage if run.resume_plan else (
        history.lineage(history.read(run.out) or []) or uuid.uuid4().hex)
    initialised = run.resume_plan is None and run.init_plan is not None
    if initialised:  # before the start is recorded: a refused one leaves no attempt
        init_from.check_init(run.init_plan)
    plan = choose(run.resume_plan, run.layout.world_size, run.layout.tp, run.layout.pp,
                  run.ds_config.get("zero_optimization", {}).get("stage", 0),
                  (run.out, history.attempt_fields(lineage, run.settings, run.setting_sources)))
    try:
        changes = same_run.training_changes(os.path.join(plan.directory, plan.tag), run.training,
                                            run.allow_training_changes) if plan else []
        if plan and plan.candidates != run.resume_plan.candidates:  # a fallback: as the first
            for line in same_run.moved_rate(os.path.join(plan.directory, plan.tag), run.steps,
                                            run.ds_config.get("scheduler"),
                                            run.allow_training_changes):
                logger.info(line)  # a note, as the first one's (config.moved_rate)
    except ValueError as error:
        raise Refused(str(error)) from None
    if plan is None and run.init_plan is not None and not initialised:  # none could be resumed
        init_from.check_init(run.init_plan)
    run.ds_config.setdefault("checkpoint", {})["load_universal"] = bool(
        plan and plan.resharding and plan.resharding.convert)
    return Start(plan, changes, lineage)


def load_or_initialise(run, engine, start: Start) -> tuple:
    """Into the engine: the checkpoint resumed, its training changes said and applied; else
    --branch's checkpoint or --init-from's weights. (The state the checkpoint held, or None;
    whether the run branched.)"""
    init, state = run.init_plan, None
    branched = start.plan is None and init is not None and init.branch
    if start.plan is not None:
        state = loading.load(engine, start.plan, run.seed)
        rate_from_schedule(engine)
    elif branched:
        state = init_from.branch_from(engine, init)
    elif init is not None:
        init_from.init_from(engine, init)
    if start.training_changes or branched:  # a branch's schedule from its first step
        apply_config(engine, run.ds_config)
    for line in [*start.training_changes, *(init.changes if branched else ())]:
        logger.info(line)
    return state, branched
