"""The resume plan: which checkpoint a run resumes and, should its files not verify, which older
ones in turn, decided before any process starts (`plan_resume`, from config.load) from the run's
history and what its folder holds (`history.decide`).

Every rank then verifies the plan (`choice.py`) before the engine is built and the checkpoint
loaded (`loading.py`); rank 0 appends to the history what the start spent and moved. Also what
--out holds for --check-only (`what_is_where`)."""

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import List, Optional

from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import history, manifest, reads, reshard


@dataclass(frozen=True)
class ResumePlan:
    """What a run resumes, decided before any process starts."""
    directory: str  # OUT/checkpoints
    candidates: tuple  # steps, newest first: the one to resume, then its lineage's older ones
    resharding: Optional[reshard.Reshard]  # how candidates[0] loads on this layout
    by_hand: bool  # --resume-from: that one or none
    verified: bool = True  # False: written by an earlier tupe_ds, without a manifest
    passed_over: tuple = ()  # lines: newer step folders that are not resumed, and why
    notes: tuple = ()  # lines to say
    fresh_start: Optional[dict] = None  # --fresh-start's consent: from step 0 if none verifies
    records: tuple = ()  # the run's history as read (or rebuilt from the manifests)
    appends: tuple = ()  # what the start records before it acts (rank 0): rebuilt, adopted, spent
    lineage: str = ""  # the run's
    giving_up: Optional[str] = None  # the id --giving-up names: lines suggest the flag with it

    @property
    def tag(self) -> str:
        return folders.tag_of(self.candidates[0])


def describe_steps(steps) -> str:
    return ", ".join(folders.tag_of(s) for s in sorted(steps))


def listing(directory: str, complete: dict, damaged: dict) -> history.Listing:
    """What CHECKPOINTS holds, as history.decide reads it."""
    return history.Listing(
        tuple(history.Folder(step, history.checkpoint_id(complete[step]), complete[step][
            "lineage"]) if step in complete else history.Folder(step, problem=damaged.get(step))
              for step in folders.step_folders(directory)))


def plan_resume(out: str, resume: str, resume_from: Optional[str], world_size: int, tp: int,
                pp: int, zero_stage: int, fresh_start: bool = False,
                giving_up: Optional[str] = None) -> Optional[ResumePlan]:
    """What --out holds to resume (None: nothing, a fresh start); ValueError saying what to do
    when it cannot be resumed on this layout, when --resume never meets checkpoints, when the
    history records a checkpoint the folder has lost, when a newer checkpoint of another run is
    in the way, or when it holds checkpoints of which none reads and the run would start from
    step 0 without --fresh-start. A checkpoint whose manifest does not read is not complete:
    passed over (and set aside by `choose`) when newer, never a fallback."""
    directory = os.path.join(out, "checkpoints")
    complete, damaged = folders.survey(directory)
    records = history.read(out)
    lost_history = not records  # none, or emptied: made again from the manifests
    records, kept, notes = records or [], folders.set_aside_manifests(directory), ()
    appends = history.rebuilt(records, {history.checkpoint_id(m): m for m in complete.values()},
                              kept, applied_earlier(out, complete) if lost_history else ())
    if lost_history and appends:
        notes = (f"tupe-pretrain: {out}/{history.FILE} is not there: the run's history is "
                 "made again from its checkpoints' manifests",)
        refuse_lost_newest(out, directory, complete, kept, resume_from or fresh_start)
    elif appends:
        notes = (f"tupe-pretrain: {out}/{history.FILE} lacks consents its checkpoints carry (its "
                 "end was lost?): taken from their manifests",)
    run_lineage = (history.lineage([*records, *appends]) or run_description.lineage(out)
                   or (complete[max(complete)]["lineage"] if complete else uuid.uuid4().hex))
    legacy = folders.legacy_step(directory) if not records and not complete and not kept else None
    live = history.live([*records, *appends])
    if resume == "never":
        held = sorted(set(complete) | set(damaged) | ({legacy} if legacy else set()))
        if held or live:
            raise ValueError(
                f"--resume never, and it holds checkpoints of a run "
                f"({describe_steps(held) or 'its history records ' + describe_steps(c.step for c in live)}"
                f"): nothing is overwritten. To continue that run leave out --resume never; to "
                f"start over give another --out" + (
                    f"; to start a new run from its weights, --out NEW --init-from "
                    f"{os.path.join(directory, folders.tag_of(held[-1]))}" if held else ""))
        return None
    step = resume_from_step(directory, resume_from) if resume_from is not None else None
    if legacy and step in (None, legacy):
        return ResumePlan(directory, (legacy,), plan_layout(directory, legacy, world_size, tp,
                                                            pp, zero_stage, False),
                          step is not None, verified=False, lineage=run_lineage)
    base = [*records, *appends]
    if live and live[-1].step not in complete and appeared(directory, live[-1].step):
        complete, damaged = folders.survey(directory)
    decision = history.decide(base, listing(directory, complete, damaged),
                              history.Flags(step, fresh_start, giving_up), run_lineage)
    if decision.refusal:
        raise ValueError(" ".join([*decision.notes, decision.refusal]))
    candidates = decision.candidates
    ours = [s for s in complete if complete[s]["lineage"] == run_lineage]
    foreign = [s for s in complete if complete[s]["lineage"] != run_lineage and s > max(
        candidates or ours or [-1]) and not decision.by_hand]
    if foreign and candidates:
        raise ValueError(
            f"{directory}/{folders.tag_of(foreign[-1])} is another run's checkpoint (lineage "
            f"{complete[foreign[-1]]['lineage']}; this run's is {run_lineage}), newer than this "
            f"run's newest, {folders.tag_of(candidates[0])}: move {describe_steps(foreign)} out "
            f"of {directory}, or resume this run's own with --resume-from "
            f"{folders.tag_of(candidates[0])} (newer folders are then set aside, not deleted)")
    if complete and not ours and not candidates:
        raise ValueError(
            f"{directory} holds no checkpoint of this run (lineage {run_lineage}), only another "
            f"run's ({describe_steps(complete)}): to continue that run here, --resume-from "
            f"{folders.tag_of(max(complete))}; else move them out of the folder")
    newest = candidates[0] if candidates else -1
    committed = {c.step for c in history.live(base)} - set(complete) - set(damaged)
    problems = {**damaged, **{s: "no manifest.json, though the run's history records it committed"
                              for s in committed if s in folders.step_folders(directory)}}
    passed_over = tuple(f"{folders.tag_of(s)}: {problem}" for s, problem in sorted(problems.items())
                        if s > newest)
    plan = ResumePlan(directory, candidates, None, decision.by_hand, True, passed_over,
                      notes + decision.notes, decision.fresh_start, tuple(records),
                      tuple(appends) + decision.appends, run_lineage, giving_up)
    if not candidates:
        if not passed_over and not live:
            return plan if plan.appends or plan.fresh_start or plan.notes else None
        if decision.fresh_start is None:
            found = [(folders.tag_of(s), damaged.get(s, "no manifest.json (not complete)"))
                     for s in reversed(folders.step_folders(directory))]
            raise ValueError(" ".join([*decision.notes, none_resumable(
                directory, found, live[-1].id if live else "none",
                                            "" if found else
                                            f", though the run's history records "
                                            f"{describe_steps(c.step for c in live)} as committed"
                                            " (were they moved?)")]))
        return plan
    return dataclasses.replace(plan, resharding=plan_layout(directory, candidates[0], world_size,
                                                            tp, pp, zero_stage))


def applied_earlier(out: str, complete: dict) -> List[str]:
    """The --resume-from an earlier tupe_ds recorded as applied (OUT/run.json's `resume_from`,
    a manifest's `resume_from_applied`): spent, for a history made again."""
    tags = [m["resume_from_applied"] for m in complete.values()
            if isinstance(m.get("resume_from_applied"), str)]
    recorded = run_description.recorded(out).get("resume_from")
    if isinstance(recorded, dict) and type(recorded.get("step")) is int:
        tags.append(folders.tag_of(recorded["step"]))
    return tags


def refuse_lost_newest(out: str, directory: str, complete: dict, kept: dict,
                       consented) -> None:
    """With no history to tell, `latest` and an earlier tupe_ds's OUT/run.json name the newest
    checkpoint committed: one the folder does not hold is refused, not an older one resumed."""
    named = [folders.step_of(tag) for tag in [folders.latest_tag(directory)] if tag]
    recorded = run_description.recorded(out).get("newest_checkpoint")
    named += [recorded] if type(recorded) is int else []
    held = set(complete) | {m["step"] for m in kept.values()}
    missing = [step for step in named if step > max(held, default=-1)]
    if missing and not consented:
        older = max(complete, default=None)
        raise ValueError(
            f"{out}/{history.FILE} is not there, and {folders.tag_of(max(missing))} (named by "
            f"{directory}/latest or {out}/run.json as the newest checkpoint) is not in the folder "
            "either: were both lost? Nothing was moved or deleted. Put them back and run the "
            "same command" + (f"; or go on from {folders.tag_of(older)} deliberately: "
                              f"--resume-from {folders.tag_of(older)}" if older is not None else
                              "; or start over in another --out"))


def appeared(directory: str, step: int) -> bool:
    """Whether the manifest of step folder `step`, which the history records as the run's
    newest, shows within the retry window (a stale NFS listing, or ENOENT for a while after a
    server hiccup)."""
    path = os.path.join(directory, folders.tag_of(step), manifest.MANIFEST)
    try:
        reads.retried(path, lambda: os.stat(path), expected=True)
    except FileNotFoundError:
        return False
    return True


def resume_from_step(directory: str, resume_from: str) -> int:
    """The step --resume-from names: stepN, or the path of a step folder of --out's checkpoints;
    ValueError for any other path (a checkpoint of another folder is --init-from's)."""
    name = os.path.basename(resume_from.rstrip("/"))
    if os.sep in resume_from.rstrip("/"):
        inside = os.path.realpath(os.path.dirname(resume_from.rstrip("/")))
        if inside != os.path.realpath(directory):
            raise ValueError(
                f"--resume-from {resume_from} is not a checkpoint of this run folder "
                f"({directory}): give one of its own (stepN), start a new run from that "
                f"checkpoint with --init-from {resume_from}, or give its run folder as --out")
    try:
        return folders.step_of(name)
    except ValueError as error:
        raise ValueError(f"--resume-from {resume_from}: {error}") from None


def none_resumable(directory: str, found, newest_id: str, recorded: str = "") -> str:
    """The refusal of a run that would start from step 0 though --out holds checkpoints
    (`found`: (stepN, why it cannot be resumed) each) or its history records some (`recorded`:
    the text that says so), and what to do."""
    fresh = f"--fresh-start --giving-up {newest_id}"
    if not found:
        return (f"{directory} holds no checkpoint{recorded}. Nothing was moved or deleted. Put "
                f"them back and run the same command; or, to start this run over from step 0, "
                f"add {fresh}")
    return (f"{directory} holds checkpoints of which none can be resumed: "
            + "; ".join(f"{tag}: {why}" for tag, why in found) + recorded
            + ". Nothing was moved or deleted. Mend them (restore their files) and run the same "
            f"command; or, to start this run over from step 0, add {fresh} (they are then "
            f"set aside in {os.path.join(directory, folders.SET_ASIDE)}, not deleted)")


def what_is_where(out: str, plan: Optional[ResumePlan]) -> List[str]:
    """tupe-pretrain --check-only: each step folder of OUT/checkpoints and each folder set
    aside (folders.inventory), then what a run would start from."""
    directory = os.path.join(out, "checkpoints")
    lines = folders.inventory(directory) or [f"{directory}: no checkpoint"]
    if plan is not None and plan.candidates:
        fallbacks = [] if plan.by_hand else [folders.tag_of(s) for s in plan.candidates[1:]]
        last = ("step 0 (--fresh-start)" if plan.fresh_start and not plan.by_hand else
                "a refusal, with nothing moved")
        lines.append(f"a run would resume {plan.tag} once its files verify; else, in turn: "
                     + ", ".join([*fallbacks, last]))
        newer = [s for s in folders.step_folders(directory) if s > plan.candidates[0]]
        if newer:
            lines.append(f"resuming {plan.tag}, it would set aside {describe_steps(newer)} "
                         f"(into {os.path.join(directory, folders.SET_ASIDE)}, not deleted)")
    else:
        lines.append("a run would start from step 0" + (
            ", setting the damaged checkpoints aside (--fresh-start)"
            if plan and plan.fresh_start and (plan.passed_over or history.live(
                [*plan.records, *plan.appends])) else ""))
    return lines


def plan_layout(directory: str, step: int, world_size: int, tp: int, pp: int,
                zero_stage: int, verified: bool = True) -> Optional[reshard.Reshard]:
    """How checkpoint `step` loads on this layout (reshard.plan); for one of an earlier version
    (no manifest) by its layout.json, and None without one (it resumes on its own layout)."""
    tag = folders.tag_of(step)
    step_dir = os.path.join(directory, tag)
    saved = (reshard.saved_layout(manifest.read(step_dir)) if verified else
             reshard.layout_file(step_dir))
    if saved is None:
        return None
    return reshard.plan(tag, saved, world_size, tp, pp, zero_stage,
                        reshard.has_zero_shards(os.path.join(directory, tag)))


def lineage_of(plan: Optional[ResumePlan], out: str) -> str:
    """The lineage the run's checkpoints belong to: the plan's, else the one its history or
    OUT/run.json records (a run started earlier in this folder), else a new one."""
    if plan is not None:
        return plan.lineage
    return (history.lineage(history.read(out) or []) or run_description.lineage(out)
            or uuid.uuid4().hex)
