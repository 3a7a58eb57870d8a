"""The choice of the checkpoint a run resumes, made by every rank before the engine is built:
the first of the resume plan's candidates whose files verify.

Rank 0's plan is taken once every rank sees its checkpoints alike (`agree_with_rank_0`); each
candidate's files are verified by all ranks, each checking a share (`verify`); one that fails is
said file by file and the next is tried, and the step folders newer than the one chosen are set
aside (`choose`)."""

import dataclasses
import os
import socket
from typing import List, Optional

import torch.distributed as dist

from tupe_ds.tools.files import NotRegularFile
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import history, manifest, reads, reshard, safe_load
from tupe_ds.train.checkpoint.resume import ResumePlan, none_resumable, plan_layout
from tupe_ds.train.flags import Refused


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
           say, attempt: Optional[tuple] = None) -> Optional[ResumePlan]:
    """Collective: the first of rank 0's plan's candidates whose files verify, as a plan of its
    own (None: a fresh start); what failed is said file by file, and every step folder newer
    than the one chosen (failed, damaged, incomplete, or beyond --resume-from) is set aside.
    When none verifies: Refused, naming each, with nothing moved (for --resume-from, or without
    --fresh-start); with --fresh-start, from step 0 with them set aside. A file the filesystem
    does not give stops every rank before anything is moved (reads.Unreadable). Rank 0 then
    records in the run's history what the start spent and moved, and `attempt` ((OUT, fields):
    this start)."""
    plan = agree_with_rank_0(plan)
    if plan is None:
        if attempt is not None:
            reads.gathered(lambda: record_start(attempt, None, None, []) if dist.get_rank() == 0
                           else None, "rank 0 to record the start in the run's history")
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
            chosen = plan if not failed else dataclasses.replace(
                plan, candidates=plan.candidates[len(failed):], resharding=fallback_layout(
                    plan.directory, step, world_size, tp, pp, zero_stage))
            break
        say(f"tupe-pretrain: checkpoint {folders.tag_of(step)} failed verification: "
            + "; ".join(problems))
        failed[step] = problems
        if plan.by_hand:
            raise Refused(f"--resume-from {folders.tag_of(step)}: the checkpoint does not "
                          "verify (above); restore its files or choose another")
    newest_id = history.live([*plan.records, *plan.appends])
    newest_id = newest_id[-1].id if newest_id else "none"
    if chosen is not None and plan.fresh_start:
        say(f"tupe-pretrain: --fresh-start not taken: {chosen.tag} can be resumed (a fresh start "
            "is only for a folder none of whose checkpoints can; the flag is now spent: a later "
            f"attempt that needs it says so)")
    if chosen is not None and failed:
        say(f"tupe-pretrain: resuming from {chosen.tag}, the previous complete checkpoint")
    elif chosen is None and plan.candidates and not plan.fresh_start:
        raise Refused(none_resumable(plan.directory, [
            (folders.tag_of(step), problems[0] + (f" (and {len(problems) - 1} more, above)"
                                                  if len(problems) > 1 else ""))
            for step, problems in sorted(failed.items(), reverse=True)], newest_id))
    elif chosen is None and (plan.candidates or plan.passed_over):
        say(f"tupe-pretrain: no checkpoint of {plan.directory} can be resumed (above): starting "
            "anew from step 0 (--fresh-start); they are set aside, not deleted")

    def set_aside_newer():
        keep_from = chosen.candidates[0] if chosen else -1
        # starting anew: another run's complete checkpoints stay where they are
        complete = folders.survey(plan.directory)[0]
        others = set() if chosen else {s for s, m in complete.items()
                                       if m["lineage"] != plan.lineage}
        newer = [s for s in folders.step_folders(plan.directory) if s > keep_from
                 and s not in others]
        committed = {c.step: c.id for c in history.live([*plan.records, *plan.appends])}
        moved = [history.record("set_aside", step=s, id=history.checkpoint_id(complete[s])
                                if s in complete else committed.get(s), why="newer than the "
                                "checkpoint resumed" if chosen else "--fresh-start") for s in newer]
        record_start(attempt or (os.path.dirname(plan.directory), None), plan, chosen, moved)
        said = folders.set_aside(plan.directory, newer, (
            f"newer than {chosen.tag}, the checkpoint resumed" if chosen else
            "none could be resumed, --fresh-start") + ": failed, damaged, incomplete or left by "
            "--resume-from")
        if said:
            print(said, flush=True)

    reads.gathered(set_aside_newer if dist.get_rank() == 0 else lambda: None,
                   "rank 0 to set aside the folders newer than the checkpoint resumed")
    return chosen


def record_start(attempt: tuple, plan: Optional[ResumePlan], chosen: Optional[ResumePlan],
                 moved: list) -> None:
    """Rank 0: appends to the run's history, before anything is moved, what the plan rebuilt,
    adopted and spent, this start (`attempt`: (OUT, its fields, or None)), --fresh-start's
    outcome, and the folders about to be set aside (`moved`)."""
    out, fields = attempt
    records = list(plan.records) if plan else history.read(out) or []
    new = list(plan.appends) if plan else []
    if fields is not None:
        new.append(history.record("attempt", **fields))
    if plan is not None and plan.fresh_start:
        live = [c.id for c in history.live([*records, *new])]
        taken = chosen is None and bool(plan.candidates or plan.passed_over or moved or live)
        new.append({**plan.fresh_start, "outcome": "applied" if taken else "not taken",
                    "gives_up": live if taken else []})
    try:
        history.append(out, records, [*new, *moved])
    except OSError as error:  # a full disk: every rank stops alike, nothing moved
        raise reads.Unreadable(f"could not write {os.path.join(out, history.FILE)} "
                               f"({reads.error_text(error)}): nothing was moved or deleted; run "
                               "the same command once the filesystem has space") from None


def fallback_layout(directory: str, step: int, world_size: int, tp: int, pp: int,
                    zero_stage: int) -> Optional[reshard.Reshard]:
    try:
        return plan_layout(directory, step, world_size, tp, pp, zero_stage)
    except ValueError as error:
        raise Refused(f"falling back to {folders.tag_of(step)}: {error}") from None
