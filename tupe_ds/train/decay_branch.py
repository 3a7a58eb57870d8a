"""A decay branch (--init-from with --branch): the checks that it goes on only in an --out of its
own, starts after its checkpoint's step with its decay after it, and says (or refuses) a first
learning rate other than the one its checkpoint last ran at."""

import dataclasses
import math

from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import InitPlan, ResumePlan, manifest
from tupe_ds.train.flags import fail
from tupe_ds.train.schedule import branch_rates


def refuse_another_branch(out: str, origin: str, plan: ResumePlan) -> None:
    """--branch into an --out with checkpoints: only the same branch goes on there (the same
    command again), never the run it branches from or another branch."""
    recorded = run_description.branched_from(out)
    if recorded == origin:
        return
    held = f"{plan.directory}/{plan.tag}"
    if recorded is None:
        fail(f"--branch: --out {out} holds checkpoints of a run that is not a branch ({held}); "
             "a decay branch starts in a folder of its own: give another --out")
    fail(f"--branch: --out {out} holds the branch of {recorded} ({held}), not of {origin}; give "
         f"this branch another --out (--init-from {recorded} goes on with that one)")


def check_branch(plan: InitPlan, ds_config: dict, steps: int) -> None:
    """A decay branch starts after its checkpoint's step, and its decay does not start before
    it: the steps the stable run trained keep the rates they had."""
    if steps <= plan.step:
        fail(f"--branch from step {plan.step}: --steps {steps} leaves nothing to train; give "
             f"--steps {plan.step} + the steps of the branch")
    params = ds_config.get("scheduler", {}).get("params", {})
    decay = params.get("decay_num_steps")
    if decay is not None and steps - decay < plan.step:
        fail(f"--branch from step {plan.step}: --steps {steps} with --decay-steps {decay} starts "
             f"the decay at step {steps - decay}, before the checkpoint's; use --steps "
             f"{plan.step + decay} (or fewer --decay-steps)")


def branch_rate_change(plan: InitPlan, ds_config: dict, allow: bool) -> InitPlan:
    """A decay branch whose first rate is not the one its checkpoint's last step ran at says both
    (a line among the plan's changes); refused without --allow-training-changes where it is
    higher: a branch from a run already decaying would warm back up."""
    schedule = manifest.read(plan.step_dir).get("lr_schedule")  # as its start ran it
    if schedule is None:
        note = (f"tupe-pretrain: --branch: the rate step {plan.step} ran at is not known (its "
                "manifest, written before tupe_ds recorded schedules, says none); the branch "
                "starts at its own schedule's")
        return dataclasses.replace(plan, changes=(*plan.changes, note))
    last, first = branch_rates(schedule, plan.step, ds_config.get("scheduler"))
    if math.isnan(last) or math.isnan(first) or math.isclose(first, last, rel_tol=1e-6,
                                                             abs_tol=1e-12):
        return plan
    change = (f"--branch from step {plan.step}: its last step ran at learning rate {last:.4g}, "
              f"this schedule's first (step {plan.step + 1}) at {first:.4g}")
    if first > last and not allow:
        fail(f"{change}: the rate would warm back up (the checkpoint's run was already "
             "decaying). Branch from a checkpoint of the stable phase, or add "
             "--allow-training-changes to go on so")
    return dataclasses.replace(plan, changes=(*plan.changes, f"tupe-pretrain: {change}"))
