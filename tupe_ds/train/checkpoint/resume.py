"""Which checkpoint a run starts from, checked twice: before any process starts (`plan_resume`,
`plan_init`: manifests, identity and layout, from config.load), then by every rank (`choose`:
the files verified, with a fallback) before the engine is built and the state loaded (`load`,
`init_from`)."""

import os
import socket
import uuid
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train import run_description
from tupe_ds.tools.files import NotRegularFile, regular_file
from tupe_ds.train.checkpoint import identity, manifest, reads, reshard, safe_load
from tupe_ds.train.checkpoint.rng import derive_rng_state, file_name, load_rng_state
from tupe_ds.train.flags import Refused
from tupe_ds.train.waits import announced


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


@dataclass(frozen=True)
class InitPlan:
    """--init-from: the weights (and, with --init-optimizer, Adam's state) of another run's
    checkpoint, in a new run; with --branch all of its state, the run going on from its step."""
    step_dir: str
    with_optimizer: bool
    branch: bool = False
    step: int = 0  # the checkpoint's
    changes: tuple = ()  # lines: how a branch's training settings differ from the checkpoint's


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


def applied_earlier(out: str, step: int, complete: dict, own: Optional[str]) -> tuple:
    """When --resume-from `step` was applied by an earlier attempt, and the run resumed from it
    then wrote checkpoints that are complete here: those and `step` (when it is still there),
    newest first; else (). Applied means OUT/run.json records it; where run.json records no
    --resume-from because it is damaged or gone, the manifests tell (`resume_from_applied`, each
    checkpoint's). The checkpoints written since are those run.json lists and those whose
    manifest records this --resume-from: a kill between a commit and run.json loses neither."""
    record = run_description.resume_from_record(out)
    if record is None and run_description.exists_whole(out) or \
            record is not None and record["step"] != step:
        return ()
    tag = folders.tag_of(step)
    lineage = own or (complete[step]["lineage"] if step in complete else None)
    written = set(record["written"] if record else ()) | {
        s for s, checkpoint in complete.items() if checkpoint.get("resume_from_applied") == tag}
    since = [s for s in written if s > step and s in complete
             and (lineage is None or complete[s]["lineage"] == lineage)]
    if not since:
        return ()
    return tuple(sorted(since + ([step] if step in complete else []), reverse=True))


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


def refuse_another_run(plan: ResumePlan, current: dict, training: dict,
                       allow_training_changes: bool) -> None:
    """ValueError naming every difference between the checkpoint's identity and this run's, and
    between their optimizer and schedule settings (training_changes)."""
    if not plan.verified or not plan.candidates:
        return  # an earlier version recorded none; or nothing to resume
    step_dir = os.path.join(plan.directory, plan.tag)
    saved = manifest.read(step_dir)
    differences = identity.differences(saved["identity"], current)
    if differences:
        start_anew = (f"to change them deliberately, start a new run from its weights: --out NEW "
                      f"--init-from {step_dir}" if not init_differences(saved, current) else
                      "else start a new run in another --out")
        raise ValueError(f"{step_dir} is another run than this command's: "
                         + "; ".join(differences) + f". Resume it with its own settings; "
                         f"{start_anew}")
    training_changes(step_dir, training, allow_training_changes)


def records_training(plan: "ResumePlan") -> bool:
    """Whether the checkpoint resumed records its training settings (this tupe_ds's do)."""
    return not plan.verified or "training" in manifest.read(
        os.path.join(plan.directory, plan.tag))


def training_changes(step_dir: str, training: dict, allow: bool,
                     doing: str = "resuming") -> List[str]:
    """The lines that say how this run's optimizer and schedule settings differ from the
    checkpoint's, when `allow` (--allow-training-changes) lets them; ValueError naming them
    otherwise, and always for the settings the checkpoint's optimizer state was made with
    (identity.CHANGEABLE_AT_RESUME)."""
    saved = manifest.read(step_dir)
    if "training" not in saved:
        return []  # written before the settings were recorded
    changeable = identity.CHANGEABLE_AT_RESUME.match
    fixed = identity.differences(saved["training"], training, lambda key: not changeable(key))
    if fixed:
        raise ValueError(
            f"{step_dir} was trained with other settings, which its optimizer state was made "
            "with and a resumed run cannot change: " + "; ".join(fixed) + ". Resume with the "
            f"checkpoint's settings, or start a new run from its weights: --out NEW --init-from "
            f"{step_dir}")
    changes = identity.differences(saved["training"], training, changeable)
    if changes and not allow:
        raise ValueError(
            f"{step_dir} was trained with other optimizer or schedule settings: "
            + "; ".join(changes) + ". Resume with the checkpoint's settings, or add "
            "--allow-training-changes to go on with these (the run then says what changed)")
    why = " (--allow-training-changes)" if doing == "resuming" else ""
    return [f"tupe-pretrain: {doing} {os.path.basename(step_dir)} with changed training "
            f"settings{why}: {change}" for change in changes]


def init_differences(saved: dict, current: dict) -> List[str]:
    """How a checkpoint's model differs from this run's in what --init-from cannot change (the
    vocabulary and the parameters; the sequence length, dropout and precision may change)."""
    changeable = {"seq_length", "hidden_dropout", "attention_dropout", "dtype"}
    return identity.differences(
        {"vocabulary": saved["identity"].get("vocabulary"), "models": [
            {k: v for k, v in m.items() if k not in changeable}
            for m in model_list(saved["identity"].get("models"), saved["tag"])]},
        {"vocabulary": current["vocabulary"], "models": [
            {k: v for k, v in m.items() if k not in changeable} for m in current["models"]]})


def plan_init(init_from: str, with_optimizer: bool, current: dict, world_size: int, tp: int,
              pp: int, zero_stage: int, branch: bool = False,
              training: Optional[dict] = None) -> InitPlan:
    """--init-from CHECKPOINT (a stepN folder, or a run's folder or checkpoints folder for its
    newest complete one), checked: complete, the same vocabulary and the same parameters (the
    sequence length, dropout and precision may change), a layout it loads on. A --branch goes
    on with the checkpoint's run: the same identity (stream and model), the optimizer settings
    its state was made with (the schedule may change: `training`), and the layout its optimizer
    state and random streams load on."""
    path = os.path.abspath(init_from)
    for sub in ("checkpoints", ""):
        steps = folders.complete_steps(os.path.join(path, sub))
        if steps:
            path = os.path.join(path, sub, folders.tag_of(steps[-1]))
            break
    if not manifest.exists(path):
        raise ValueError(f"--init-from {init_from}: not a complete checkpoint (no "
                         "manifest.json); give RUN_DIR, RUN_DIR/checkpoints or .../stepN")
    saved = manifest.read(path)
    layout = reshard.saved_layout(saved)
    differences = init_differences(saved, current)
    if differences:
        raise ValueError(f"--init-from {path}: its model is not this run's: "
                         + "; ".join(differences))
    dp = world_size // (tp * pp)
    if (layout.tp, layout.pp) != (tp, pp):
        raise ValueError(f"--init-from {path}: written with --tp {layout.tp} --pp {layout.pp}; "
                         "its weights load with the same --tp and --pp")
    if 3 in (layout.zero_stage, zero_stage) and (layout.zero_stage, layout.dp) != (zero_stage, dp):
        raise ValueError(f"--init-from {path}: written by {layout} with ZeRO stage "
                         f"{layout.zero_stage}; under ZeRO stage 3 the weights are partitioned "
                         f"with the optimizer state, so they load on that layout "
                         f"({layout.world_size} processes) with --zero-stage "
                         f"{layout.zero_stage} only")
    flag = "--branch" if branch else "--init-optimizer"
    if (with_optimizer or branch) and (layout.dp != dp
                                       or (layout.zero_stage == 0) != (zero_stage == 0)):
        raise ValueError(f"{flag}: {path} was written by {layout} with ZeRO stage "
                         f"{layout.zero_stage}; its optimizer state loads on that layout "
                         f"({layout.world_size} processes) and ZeRO stage only")
    if not branch:
        return InitPlan(path, with_optimizer)
    differences = identity.differences(saved["identity"], current)
    if differences:
        raise ValueError(f"--branch: {path} is another run than this command's: "
                         + "; ".join(differences) + ". A branch continues the checkpoint's "
                         "stream and model; to change them start from its weights alone (leave "
                         "out --branch)")
    changes = training_changes(path, training, True, "branching from") if training else []
    return InitPlan(path, True, branch=True, step=folders.step_of(os.path.basename(path)),
                    changes=tuple(changes))


def model_list(models, tag: str) -> list:
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ValueError(f"checkpoint {tag}: its manifest records no model configs")
    return models


def verify(step_dir: str) -> List[str]:
    """Collective: the problems of the checkpoint's files (manifest.check_files, and on rank 0
    every file the manifest does not list), each rank checking a share of them; the same list
    on every rank. What is not damage stops every rank alike: a file the filesystem does not
    give (reads.Unreadable, exit code 3), one the installed software cannot load that other
    versions wrote (Refused)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def my_share():  # (problems, refusal)
        try:
            record = manifest.read(step_dir)
            files = record["files"]
            names = sorted(files)[rank::world]
            problems = manifest.check_files(step_dir, {n: files[n] for n in names},
                                            record.get("software"))
            if rank == 0:
                problems += manifest.unlisted(step_dir, files)
            return problems, None
        except safe_load.OtherSoftware as error:
            return [], str(error)
        except reads.Unreadable:
            raise
        except Exception as error:  # on one rank, and the others wait in the gather below
            return [f"{step_dir}: {type(error).__name__}: {error}"], None

    every_rank = reads.gathered(my_share, f"every rank to verify its share of {step_dir}")
    refusal = next((refusal for _, refusal in every_rank if refusal), None)
    if refusal:
        raise Refused(refusal)
    return sorted({p for problems, _ in every_rank for p in problems})


def agree_with_rank_0(plan: Optional[ResumePlan]) -> Optional[ResumePlan]:
    """Collective: rank 0's plan (made under the run folder's lock), once every rank found the
    checkpoints it names as rank 0 sees them (the same manifests); Refused naming the ranks that
    do not (a filesystem that shows a node another folder, or the files late)."""
    rank = dist.get_rank()
    view_of_rank_0 = reads.gathered(lambda: seen(plan) if rank == 0 else None,
                                    "rank 0 to read the manifests of the checkpoints it chose")[0]
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    chosen = shared[0]

    def differences():
        view = seen(chosen)
        return None if view == view_of_rank_0 else (
            f"rank {rank} on {socket.gethostname()} sees "
            + ", ".join(f"{folders.tag_of(step)} {'otherwise' if digest else 'not at all'}"
                        for (step, digest), (_, theirs) in zip(view, view_of_rank_0)
                        if digest != theirs))

    differing = [line for line in reads.gathered(differences,
                                                   "every rank to read those manifests") if line]
    if differing:
        raise Refused(
            f"the ranks see different checkpoints in {chosen.directory}: rank 0 would resume "
            f"{chosen.tag}, and {'; '.join(differing)}. Is --out a folder every node shares, "
            "the same for every rank? (Or wait until the filesystem shows every node the same "
            "files, then run the same command.)")
    return chosen


def seen(plan: Optional[ResumePlan]) -> tuple:
    """(step, the digest of its manifest, or None where it is not seen) of the plan's
    candidates: what this rank sees of them (reads.Unreadable when the filesystem does not
    say)."""
    if plan is None:
        return ()
    view = []
    for step in plan.candidates:
        try:
            view.append((step, manifest.digest(os.path.join(plan.directory, folders.tag_of(step)))
                         if plan.verified else os.path.isdir(
                             os.path.join(plan.directory, folders.tag_of(step)))))
        except (FileNotFoundError, NotRegularFile):
            view.append((step, None))
    return tuple(view)


def choose(plan: Optional[ResumePlan], world_size: int, tp: int, pp: int, zero_stage: int,
           say) -> Optional[ResumePlan]:
    """Collective: the first of rank 0's plan's candidates whose files verify, as a plan of its
    own (None: a fresh start); what failed is said file by file, and every step folder newer
    than the one chosen (failed, damaged, incomplete, or beyond --resume-from) is set aside.
    When none verifies: Refused, naming each, with nothing moved (for --resume-from, or without
    --fresh-start); with --fresh-start, from step 0 with them set aside. A file the filesystem
    does not give stops every rank before anything is moved (reads.Unreadable)."""
    plan = agree_with_rank_0(plan)
    if plan is None:
        return None
    for line in plan.passed_over:
        say(f"tupe-pretrain: checkpoint {line}: not complete, not resumed")
    for line in plan.notes:
        say(line)
    if not plan.verified:
        say(f"tupe-pretrain: checkpoint {plan.tag} was written by an earlier tupe_ds, without a "
            "manifest: resumed unverified; its next checkpoints have one")
    failed, chosen = {}, None
    for step in plan.candidates:
        step_dir = os.path.join(plan.directory, folders.tag_of(step))
        problems = verify(step_dir) if plan.verified else []
        if not problems:
            chosen = plan if not failed else ResumePlan(
                plan.directory, plan.candidates[len(failed):],
                fallback_layout(plan.directory, step, world_size, tp, pp, zero_stage),
                plan.by_hand)
            break
        say(f"tupe-pretrain: checkpoint {folders.tag_of(step)} failed verification: "
            + "; ".join(problems))
        failed[step] = problems
        if plan.by_hand:
            raise Refused(f"--resume-from {folders.tag_of(step)}: the checkpoint does not "
                          "verify (above); restore its files or choose another")
    if chosen is not None and plan.fresh_start:
        say(f"tupe-pretrain: --fresh-start not taken: {chosen.tag} can be resumed (a fresh start "
            "is only for a folder none of whose checkpoints can)")
    if chosen is not None and failed:
        say(f"tupe-pretrain: resuming from {chosen.tag}, the previous complete checkpoint")
    elif chosen is None and plan.candidates and not plan.fresh_start:
        raise Refused(none_resumable(plan.directory, [
            (folders.tag_of(step), problems[0] + (f" (and {len(problems) - 1} more, above)"
                                                  if len(problems) > 1 else ""))
            for step, problems in sorted(failed.items(), reverse=True)]))
    elif chosen is None:
        say(f"tupe-pretrain: no checkpoint of {plan.directory} can be resumed (above): starting "
            "anew from step 0 (--fresh-start); they are set aside, not deleted")

    def set_aside_newer():
        keep_from = chosen.candidates[0] if chosen else -1
        # starting anew: another run's complete checkpoints stay where they are
        others = set() if chosen else set(folders.complete_steps(plan.directory)) - set(
            plan.candidates)
        newer = [s for s in folders.step_folders(plan.directory) if s > keep_from
                 and s not in others]
        said = folders.set_aside(plan.directory, newer, (
            f"newer than {chosen.tag}, the checkpoint resumed" if chosen else
            "none could be resumed, --fresh-start") + ": failed, damaged, incomplete or left by "
            "--resume-from")
        if said:
            print(said, flush=True)

    reads.gathered(set_aside_newer if dist.get_rank() == 0 else lambda: None,
                   "rank 0 to set aside the folders newer than the checkpoint resumed")
    return chosen


def fallback_layout(directory: str, step: int, world_size: int, tp: int, pp: int,
                    zero_stage: int) -> Optional[reshard.Reshard]:
    try:
        return plan_layout(directory, step, world_size, tp, pp, zero_stage)
    except ValueError as error:
        raise Refused(f"falling back to {folders.tag_of(step)}: {error}") from None


def confirm_loaded(tag: str, step: int) -> None:
    """Collective: every rank loaded the same checkpoint (its tag and the step it holds)."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, (tag, step, socket.gethostname()))
    if len({(t, s) for t, s, _ in every_rank}) > 1:
        raise Refused("the ranks loaded different checkpoints: " + "; ".join(
            f"rank {rank} on {host}: {t} (step {s})"
            for rank, (t, s, host) in enumerate(every_rank)))


def lineage_of(plan: Optional[ResumePlan], out: str) -> str:
    """The lineage the run's checkpoints belong to: the resumed checkpoint's, else the one
    OUT/run.json records (a run started earlier in this folder), else a new one."""
    if plan is not None and plan.verified:
        return manifest.read(os.path.join(plan.directory, plan.tag))["lineage"]
    return run_description.lineage(out) or uuid.uuid4().hex


def load(engine, plan: ResumePlan, seed: int) -> dict:
    """Collective: the client state of the chosen checkpoint, loaded into `engine`. On a new
    layout, through DeepSpeed's universal checkpoint when ZeRO shards are in it."""
    rank, tag, directory = dist.get_rank(), plan.tag, plan.directory
    load_dir, resharding = directory, plan.resharding
    if resharding is not None:
        if resharding.convert:
            if rank == 0:
                seconds = reshard.convert(directory, tag)
                print(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; "
                      f"converted for {dist.get_world_size()} processes with DeepSpeed's "
                      f"universal checkpoint into {reshard.universal_dir(directory)}/{tag} "
                      f"({'reused' if seconds == 0 else f'{seconds:.1f} s'})", flush=True)
            with announced(f"rank 0 to convert checkpoint {tag} for this layout", rank):
                dist.barrier()
            load_dir = reshard.universal_dir(directory)
        elif rank == 0:
            print(f"tupe-pretrain: checkpoint {tag} was written by {resharding.saved}; its "
                  "optimizer state is not partitioned and loads as it is", flush=True)
    schedule = not plan.verified or holds_schedule(os.path.join(directory, tag))
    try:
        path, client_state = engine.load_checkpoint(load_dir, tag=tag,
                                                    load_lr_scheduler_states=schedule)
    except OSError as error:  # verified a moment ago: the filesystem's, not the checkpoint's
        raise reads.Unreadable.reading(error.filename or os.path.join(load_dir, tag),
                                       error) from None
    if path is None:
        raise RuntimeError(f"{load_dir}/{tag}: DeepSpeed could not load this checkpoint")
    confirm_loaded(tag, client_state["step"])
    if resharding is not None and resharding.convert:
        place_optimizer_state(engine)
    if resharding is None:
        step_dir = os.path.join(directory, tag)
        rng_path = os.path.join(step_dir, file_name(rank))
        reads.retried(rng_path, lambda: load_rng_state(regular_file(rng_path, step_dir)))
    else:  # the old ranks' streams belong to the old layout
        derive_rng_state(seed, client_state["step"], parallel_state.get_data_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_tensor_model_parallel_rank())
    return client_state


def check_init(plan: InitPlan) -> None:
    """Collective, before the engine is built: Refused when the --init-from checkpoint's files
    do not verify."""
    problems = verify(plan.step_dir)
    if problems:
        raise Refused(f"--init-from {plan.step_dir} does not verify: " + "; ".join(problems)
                      + "; give another checkpoint")


def init_from(engine, plan: InitPlan, say) -> None:
    """Collective: the checkpoint's weights (and optimizer state), verified (check_init), into a
    new run's engine; the new run keeps its own schedule, data stream and step count."""
    directory, tag = os.path.split(plan.step_dir)
    path, _ = engine.load_checkpoint(
        directory, tag=tag, load_module_only=not plan.with_optimizer,
        load_optimizer_states=plan.with_optimizer, load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"--init-from {plan.step_dir}: DeepSpeed could not load it")
    engine.global_steps = engine.global_samples = engine.skipped_steps = 0
    say(f"tupe-pretrain: initialised from {plan.step_dir}: its weights"
        + (" and optimizer state" if plan.with_optimizer else "")
        + "; a new schedule and data stream from step 0")


def branch_from(engine, plan: InitPlan) -> dict:
    """Collective: a decay branch (--branch): everything the checkpoint holds (weights, optimizer
    state, the schedule's step, the step and data position of its client state, this rank's
    random streams; plan_init checked the layout) into a new run's engine."""
    directory, tag = os.path.split(plan.step_dir)
    try:
        path, client_state = engine.load_checkpoint(
            directory, tag=tag, load_lr_scheduler_states=holds_schedule(plan.step_dir))
    except (AssertionError, OSError) as error:  # DeepSpeed asserts its files are there
        raise RuntimeError(f"--init-from {plan.step_dir}: could not be loaded ({error!r}); was "
                           "it removed meanwhile, by its own run's --keep-checkpoints?") from None
    if path is None:
        raise RuntimeError(f"--init-from {plan.step_dir}: DeepSpeed could not load it")
    confirm_loaded(tag, client_state["step"])
    load_rng_state(os.path.join(plan.step_dir, file_name(dist.get_rank())))
    return client_state


def holds_schedule(step_dir: str) -> bool:
    """Whether the checkpoint holds a scheduler's state: one of a run without a scheduler (a
    constant rate) does not, and the schedule of a run resuming or branching from it takes its
    place from the step (schedule.follow_step)."""
    training = manifest.read(step_dir).get("training")
    return training is None or (training.get("scheduler") or {}).get("type") is not None


def place_optimizer_state(engine) -> None:
    """A universal load sets Adam's step as a CPU tensor, where torch's fused AdamW (the shipped
    configs') keeps it on the parameters' device; torch's own load_state_dict puts every state
    where its optimizer wants it (not measured on a GPU yet: on a CPU the two places are one)."""
    optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's, under ZeRO's wrapper
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(optimizer.state_dict())
