"""Where a start of tupe-pretrain goes on from: the training settings a resumed checkpoint was
trained with that this start changes, said and checked against --allow-training-changes."""

import os

from tupe_ds.train.checkpoint import allowed_changes
from tupe_ds.train.config import RunConfig
from tupe_ds.train.flags import Refused
from tupe_ds.train.optim import loaded_differences


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
