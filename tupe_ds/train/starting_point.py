"""Where a start of tupe-pretrain goes on from: the checkpoint it resumes (rank 0's plan, agreed
by every rank) with the training settings it changes, or the weights it begins with
(--init-from, --branch)."""

import dataclasses
import os
from typing import Optional

from tupe_ds.train.checkpoint import (allowed_changes, choice, history, init_from, loading,
                                      resume)
from tupe_ds.train.checkpoint.resume import ResumePlan
from tupe_ds.train.config import RunConfig
from tupe_ds.train.flags import Refused
from tupe_ds.train.optim import apply_config, loaded_differences, rate_from_schedule


@dataclasses.dataclass
class Start:
    """What a start goes on from, agreed by every rank before its engine is built."""
    plan: Optional[ResumePlan]  # the checkpoint it resumes (None: none)
    training_changes: list  # the lines that say how it trains otherwise than that checkpoint
    lineage: str  # resume.lineage_of


def agreed(run: RunConfig, say) -> Start:
    """Collective: the checkpoint the start resumes, the first of rank 0's plan whose files
    every rank verifies, with what it changes; or the --init-from checked. The engine is to
    load it through a universal checkpoint where the plan converts it to a new layout."""
    layout = run.layout
    # rank 0's plan, verified by every rank before the engine is built for it
    lineage = resume.lineage_of(run.resume_plan, run.out)
    attempt = (run.out, history.attempt_fields(lineage, run.settings, run.setting_sources))
    plan = choice.choose(run.resume_plan, layout.world_size, layout.tp, layout.pp,
                         run.ds_config.get("zero_optimization", {}).get("stage", 0),
                         lambda line: say(line, flush=True), attempt)
    training_changes = chosen_training_changes(plan, run)
    if plan is None and run.init_plan is not None:
        init_from.check_init(run.init_plan)
    convert = plan is not None and plan.resharding is not None and plan.resharding.convert
    run.ds_config.setdefault("checkpoint", {})["load_universal"] = convert
    return Start(plan, training_changes, lineage)


def load_or_initialise(run: RunConfig, engine, start: Start, say) -> tuple:
    """Into the engine: the checkpoint the start resumes, its training changes said and applied;
    else --branch's checkpoint (the run going on from its step) or --init-from's weights. Returns
    the state the checkpoint held (its step, samples consumed, ...; None: from step 0) and
    whether the run branched."""
    plan, training_changes = start.plan, start.training_changes
    state = loading.load(engine, plan, run.seed) if plan is not None else None
    if state is not None:
        rate_from_schedule(engine)
    if state is not None and not allowed_changes.records_training(plan):
        training_changes = unrecorded_training_changes(plan, run, engine)
    if training_changes:
        apply_config(engine, run.ds_config)
        for line in training_changes:
            say(line, flush=True)
    branched = state is None and run.init_plan is not None and run.init_plan.branch
    if branched:
        state = init_from.branch_from(engine, run.init_plan)
        apply_config(engine, run.ds_config)  # the branch's schedule from its first step
        for line in run.init_plan.changes:
            say(line, flush=True)
    elif state is None and run.init_plan is not None:
        init_from.init_from(engine, run.init_plan, lambda line: say(line, flush=True))
    return state, branched


def chosen_training_changes(plan, run: RunConfig) -> list:
    """How the checkpoint chosen (a fallback too) was trained otherwise, to say and apply;
    Refused when the run may not change that (allowed_changes.training_changes)."""
    if plan is None or not plan.verified:
        return []
    try:
        return allowed_changes.training_changes(os.path.join(plan.directory, plan.tag),
                                                run.training, run.allow_training_changes)
    except ValueError as error:
        raise Refused(str(error)) from None


def unrecorded_training_changes(plan, run: RunConfig, engine) -> list:
    """For a checkpoint that does not record its training settings (an earlier tupe_ds): how
    the optimizer state it restored differs from the config, read from the state itself; Refused
    as allowed_changes.training_changes would."""
    differences = loaded_differences(engine, run.ds_config)
    fixed = [line for line in differences if line.startswith("optimizer.params.amsgrad")]
    if fixed or (differences and not run.allow_training_changes):
        raise Refused(
            f"{plan.directory}/{plan.tag} (written by an earlier tupe_ds, which did not record "
            "its training settings) holds an optimizer state made otherwise: "
            + "; ".join(differences) + (". A resumed run cannot change amsgrad: start a new run "
                                       "from its weights with --init-from" if fixed else
                                       ". Resume with its settings, or add "
                                       "--allow-training-changes to go on with these"))
    return [f"tupe-pretrain: resuming {plan.tag} with changed training settings "
            f"(--allow-training-changes): {line}" for line in differences]
