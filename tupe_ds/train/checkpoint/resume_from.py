"""--resume-from: the step it names, and, as it applies once, the checkpoints that the run resumed
from it wrote since (a later attempt resumes the newest of them, `plan_resume`)."""

import os
from typing import Optional

from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import folder as folders


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
