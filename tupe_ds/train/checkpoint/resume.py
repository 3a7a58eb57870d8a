"""The resume plan: which checkpoint a run resumes and, should its files not verify, which older
ones in turn, decided before any process starts (`plan_resume`, from config.load).

From the step folders' manifests, the run's lineage (OUT/run.json), --resume-from (applied
once: `resume_from.py`) and the layout (`reshard.py`). Every rank then verifies the plan
(`choice.py`) before the engine is built and the checkpoint loaded (`loading.py`). Also what
--out holds for --check-only (`what_is_where`), and the lineage and --resume-from that the run's
own checkpoints record (`lineage_of`, `applied_tag`)."""

import os
import uuid
from dataclasses import dataclass
from typing import List, Optional

from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import manifest, reads, reshard
from tupe_ds.train.checkpoint.resume_from import applied_earlier, resume_from_step


@dataclass(frozen=True)
class ResumePlan:
    """What a run resumes, decided before any process starts."""
    directory: str  # OUT/checkpoints
    candidates: tuple  # steps, newest first: the one to resume, then its lineage's older ones
    resharding: Optional[reshard.Reshard]  # how candidates[0] loads on this layout
    by_hand: bool  # --resume-from: that one or none
    verified: bool = True  # False: written by an earlier tupe_ds, without a manifest
    passed_over: tuple = ()  # lines: newer step folders that are not resumed, and why
    notes: tuple = ()  # lines to say: what the choice rests on where run.json could not tell
    fresh_start: bool = False  # --fresh-start: from step 0 when no checkpoint can be resumed

    @property
    def tag(self) -> str:
        return folders.tag_of(self.candidates[0])


def describe_steps(steps) -> str:
    return ", ".join(folders.tag_of(s) for s in sorted(steps))


def plan_resume(out: str, resume: str, resume_from: Optional[str], world_size: int, tp: int,
                pp: int, zero_stage: int, fresh_start: bool = False) -> Optional[ResumePlan]:
    """What --out holds to resume (None: nothing, a fresh start); ValueError saying what to do
    when it cannot be resumed on this layout, when --resume never meets checkpoints, when a
    newer checkpoint of another run is in the way, or when it holds checkpoints of which none
    reads and the run would start from step 0 without --fresh-start. A checkpoint whose
    manifest does not read is not complete: passed over (and set aside by `choose`) when newer,
    never a fallback. --resume-from applies once: a later attempt that finds the checkpoints
    the run resumed from it wrote since resumes the newest of them (`applied_earlier`)."""
    directory = os.path.join(out, "checkpoints")
    complete, damaged = folders.survey(directory)
    recorded = run_description.newest_checkpoint(out)
    if recorded is not None and recorded not in complete and recorded not in damaged and \
            manifest_appears(directory, recorded):
        complete, damaged = folders.survey(directory)
    own = run_description.lineage(out)
    legacy = folders.legacy_step(directory) if own is None else None
    if resume == "never":
        held = sorted(set(complete) | set(damaged) | ({legacy} if legacy else set()))
        if held:
            raise ValueError(
                f"--resume never, and it holds checkpoints of a run ({describe_steps(held)}): "
                f"nothing is overwritten. To continue that run leave out --resume never; to "
                f"start over give another --out; to start a new run from its weights, --out NEW "
                f"--init-from {os.path.join(directory, folders.tag_of(held[-1]))}")
        if recorded is not None:
            raise ValueError(
                f"--resume never, and {out}/run.json records {folders.tag_of(recorded)} as "
                f"committed by a run in this folder, though {directory} holds none (were they "
                "moved?): nothing is overwritten. Start over in another --out")
        return None
    verified, notes = legacy is None, ()
    step = resume_from_step(directory, resume_from) if resume_from is not None else None
    resumed_since = applied_earlier(out, step, complete, own) if step is not None else ()
    if resumed_since:
        candidates, by_hand = resumed_since, False
        notes = (f"tupe-pretrain: --resume-from {folders.tag_of(step)} was applied by an earlier "
                 f"attempt, which then wrote {describe_steps(s for s in resumed_since if s > step)}"
                 f": resuming from {folders.tag_of(resumed_since[0])}, the newest (to go back to "
                 f"{folders.tag_of(step)} once more, move the newer checkpoints out of "
                 f"{directory} first)",)
    elif step is not None:
        if step in damaged:
            raise ValueError(f"--resume-from {resume_from}: {damaged[step]}; choose another "
                             f"(complete ones: {describe_steps(complete) or 'none'})")
        if step not in complete and step != legacy:
            raise ValueError(f"--resume-from {resume_from}: {directory}/{folders.tag_of(step)} "
                             f"is not a complete checkpoint (no manifest.json); complete ones: "
                             f"{describe_steps(complete) or 'none'}")
        candidates, by_hand = (step,), True
    elif complete:
        if own is None:  # no record of the run: the newest checkpoint's lineage is the run's
            own = complete[max(complete)]["lineage"]
            notes = unknown_lineage_notes(out, directory, complete, own)
        ours = [s for s in sorted(complete) if complete[s]["lineage"] == own]
        if not ours:
            raise ValueError(
                f"{directory} holds no checkpoint of this run (lineage {own} in "
                f"{out}/run.json), only another run's ({describe_steps(complete)}): to continue "
                f"that run here, --resume-from {folders.tag_of(max(complete))}; else move them "
                "out of the folder")
        foreign = [s for s in complete if s > ours[-1] and complete[s]["lineage"] != own]
        if foreign:
            raise ValueError(
                f"{directory}/{folders.tag_of(foreign[-1])} is another run's checkpoint (lineage "
                f"{complete[foreign[-1]]['lineage']}; this run's is {own}), newer than this "
                f"run's newest, {folders.tag_of(ours[-1])}: move {describe_steps(foreign)} out of "
                f"{directory}, or resume this run's own with --resume-from "
                f"{folders.tag_of(ours[-1])} (newer folders are then set aside, not deleted)")
        candidates, by_hand = tuple(reversed(ours)), False
    elif legacy:
        candidates, by_hand = (legacy,), False
    else:
        candidates, by_hand = (), False
    newest = candidates[0] if candidates else -1
    if candidates and not by_hand and recorded is not None and recorded > newest and \
            recorded not in damaged and recorded not in folders.step_folders(directory) and \
            recorded not in folders.set_aside_steps(directory):
        raise ValueError(
            f"{out}/run.json records {folders.tag_of(recorded)} as committed by this run, but "
            f"{directory} does not hold it, nor its {folders.SET_ASIDE} folder (was it moved?); "
            f"its newest is {folders.tag_of(newest)}. Nothing was moved or deleted. Put it back "
            f"and run the same command; or go on from {folders.tag_of(newest)} deliberately: "
            f"--resume-from {folders.tag_of(newest)}")
    passed_over = tuple(f"{folders.tag_of(s)}: {problem}" for s, problem in sorted(damaged.items())
                        if s > newest)
    if not candidates:
        if not passed_over and recorded is None:
            return None
        if not fresh_start:
            found = [(folders.tag_of(step), damaged.get(step, "no manifest.json (not complete)"))
                     for step in reversed(folders.step_folders(directory))]
            raise ValueError(none_resumable(directory, found, "" if recorded is None else (
                f", though {out}/run.json records {folders.tag_of(recorded)} as committed by "
                "this run (were they moved?)")))
        return ResumePlan(directory, (), None, False, True, passed_over, fresh_start=True)
    resharding = plan_layout(directory, candidates[0], world_size, tp, pp, zero_stage, verified)
    return ResumePlan(directory, candidates, resharding, by_hand, verified, passed_over, notes,
                      fresh_start)


def none_resumable(directory: str, found, recorded: str = "") -> str:
    """The refusal of a run that would start from step 0 though --out holds checkpoints
    (`found`: (stepN, why it cannot be resumed) each) or OUT/run.json records one it committed
    (`recorded`: the text that says so), and what to do."""
    if not found:
        return (f"{directory} holds no checkpoint{recorded}. Nothing was moved or deleted. Put "
                "them back and run the same command; or, to start this run over from step 0, "
                "add --fresh-start")
    return (f"{directory} holds checkpoints of which none can be resumed: "
            + "; ".join(f"{tag}: {why}" for tag, why in found) + recorded
            + ". Nothing was moved or deleted. Mend them (restore their files) and run the same "
            "command; or, to start this run over from step 0, add --fresh-start (they are then "
            f"set aside in {os.path.join(directory, folders.SET_ASIDE)}, not deleted)")


def manifest_appears(directory: str, step: int) -> bool:
    """Whether step folder `step`, which OUT/run.json records as committed, shows with its
    manifest within the retry window (a stale NFS listing, or ENOENT for a while after a server
    hiccup); False at once when tupe_ds set it aside."""
    if step in folders.set_aside_steps(directory):
        return False
    path = os.path.join(directory, folders.tag_of(step), manifest.MANIFEST)

    def there():
        if step not in folders.step_folders(directory):
            raise FileNotFoundError(2, os.strerror(2), os.path.dirname(path))
        return os.stat(path)

    try:
        reads.retried(path, there, expected=True)
    except FileNotFoundError:
        return False
    return True


def applied_tag(plan: Optional[ResumePlan]) -> Optional[str]:
    """The --resume-from a run's checkpoints record (`applied_earlier` reads it back): this
    start's, or the one the checkpoint it resumed records."""
    if plan is None or not plan.verified:
        return None
    if plan.by_hand:
        return plan.tag
    return manifest.read(os.path.join(plan.directory, plan.tag)).get("resume_from_applied")


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
            ", setting the damaged checkpoints aside (--fresh-start)" if plan else ""))
    return lines


def unknown_lineage_notes(out: str, directory: str, complete: dict, taken: str) -> tuple:
    """When OUT/run.json, which names the run's lineage, is damaged and the checkpoints are of
    several runs: the line that says which run is resumed (the newest checkpoint's) and how to
    resume another."""
    damage = run_description.damage(out)
    others = {}
    for step, record in sorted(complete.items()):
        if record["lineage"] != taken:
            others.setdefault(record["lineage"], []).append(step)
    if not damage or not others:
        return ()
    held = "; ".join(f"lineage {lineage}: {describe_steps(steps)}"
                     for lineage, steps in others.items())
    newest_other = max(step for steps in others.values() for step in steps)
    return (f"tupe-pretrain: {damage}: resuming the run of the newest checkpoint (lineage "
            f"{taken}); {directory} also holds another run's ({held}). If that one is this run, "
            f"stop and resume it with --resume-from {folders.tag_of(newest_other)}",)


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
    """The lineage the run's checkpoints belong to: the resumed checkpoint's, else the one
    OUT/run.json records (a run started earlier in this folder), else a new one."""
    if plan is not None and plan.verified:
        return manifest.read(os.path.join(plan.directory, plan.tag))["lineage"]
    return run_description.lineage(out) or uuid.uuid4().hex
