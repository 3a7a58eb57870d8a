"""A new run from a checkpoint's weights (--init-from, --init-optimizer) or all of it (--branch)."""

import dataclasses
import logging
import os

from tupe_ds.tools.errors import Refused
from tupe_ds.train import schedule
from tupe_ds.train.checkpoint import folder as folders, loading, manifest, reshard, same_run
from tupe_ds.train.flags import fail
from tupe_ds.train.run_folder import recorded_settings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InitPlan:
    """--init-from's checkpoint: its weights, with its Adam state, or all of it (a --branch)."""
    step_dir: str
    with_optimizer: bool
    branch: bool = False
    step: int = 0  # the checkpoint's
    changes: tuple = ()  # lines: how a branch's training settings differ from the checkpoint's


def plan_init(init_from: str, with_optimizer: bool, current: dict, world_size: int, tp: int,
              pp: int, zero_stage: int, branch: bool = False, training=None) -> InitPlan:
    """--init-from's plan (stepN, RUN_DIR[/checkpoints]: its newest); ValueError if unloadable."""
    path = os.path.abspath(init_from)
    for folder in (os.path.join(path, "checkpoints"), path):
        if steps := folders.complete_steps(folder):
            path = os.path.join(folder, folders.tag_of(steps[-1]))
            break
    if not manifest.exists(path):
        raise ValueError(f"--init-from {init_from}: not a complete checkpoint (no manifest.json); "
                         "give RUN_DIR, RUN_DIR/checkpoints or .../stepN")
    saved = manifest.read(path)
    layout, dp = reshard.saved_layout(saved), world_size // (tp * pp)
    if lines := same_run.init_differences(saved, current):
        raise ValueError(f"--init-from {path}: its model is not this run's: " + "; ".join(lines))
    if (layout.tp, layout.pp) != (tp, pp):
        raise ValueError(f"--init-from {path}: written with --tp {layout.tp} --pp {layout.pp}; "
                         "its weights load with the same --tp and --pp")
    if 3 in (layout.zero_stage, zero_stage) and (layout.zero_stage, layout.dp) != (zero_stage, dp):
        raise ValueError(f"--init-from {path}: written by {layout}, ZeRO stage {layout.zero_stage}"
                         "; under ZeRO stage 3 the weights are partitioned with the optimizer "
                         "state, so they load on that layout and --zero-stage only")
    if (with_optimizer or branch) and (layout.dp, layout.zero_stage == 0) != (dp, zero_stage == 0):
        raise ValueError(f"{'--branch' if branch else '--init-optimizer'}: {path} was written by "
                         f"{layout} with ZeRO stage {layout.zero_stage}; its optimizer state "
                         "loads on that layout and ZeRO stage only")
    if not branch:
        return InitPlan(path, with_optimizer)
    if lines := same_run.differences(saved["identity"], current):
        raise ValueError(f"--branch: {path} is another run than this command's: {'; '.join(lines)}"
                         ". A branch goes on with its stream and model; to change them start "
                         "from its weights alone (leave out --branch)")
    return InitPlan(path, True, True, folders.step_of(os.path.basename(path)),
                    tuple(same_run.training_changes(path, training, True, "branching from")))


def check_init(plan: InitPlan) -> None:
    """Collective, before the engine is built: Refused unless the checkpoint's files verify."""
    if problems := manifest.verify(plan.step_dir):
        directory, step = os.path.split(os.path.normpath(plan.step_dir))
        older = [s for s in folders.survey(directory)[0] if s < folders.step_of(step)]
        raise Refused(f"--init-from {plan.step_dir} does not verify: " + "; ".join(problems)
                      + "; give another checkpoint" + (
                          f", such as the previous complete one: --init-from "
                          f"{os.path.join(directory, folders.tag_of(max(older)))}" if older
                          else ""))


def init_from(engine, plan: InitPlan) -> None:
    """Collective: the checkpoint's weights (and optimizer state) into a new run's engine."""
    load(engine, plan, load_module_only=not plan.with_optimizer,
         load_optimizer_states=plan.with_optimizer, load_lr_scheduler_states=False)
    engine.global_steps = engine.global_samples = engine.skipped_steps = 0
    logger.info(f"tupe-pretrain: initialised from {plan.step_dir}: its weights" + (
        " and optimizer state" if plan.with_optimizer else "") + "; a new schedule and data "
        "stream from step 0")


def branch_from(engine, plan: InitPlan) -> dict:
    """Collective: all the checkpoint holds into a new run's engine; returns its client state."""
    state = load(engine, plan, load_lr_scheduler_states=loading.holds_schedule(plan.step_dir))
    loading.confirm_loaded(os.path.basename(plan.step_dir), state["step"])
    loading.load_rng_state(os.path.join(plan.step_dir, loading.file_name(engine.global_rank)))
    return state


def load(engine, plan: InitPlan, **options) -> dict:
    """Collective: DeepSpeed's load of the checkpoint; returns its client state."""
    try:
        path, state = engine.load_checkpoint(*os.path.split(plan.step_dir), **options)
    except (AssertionError, OSError) as error:  # DeepSpeed asserts its files are there
        raise RuntimeError(f"--init-from {plan.step_dir}: could not be loaded ({error!r}); was "
                           "it removed meanwhile, by its own run's --keep-checkpoints?") from None
    if path is None:
        raise RuntimeError(f"--init-from {plan.step_dir}: DeepSpeed could not load it")
    return state


def refuse_another_branch(args, plan) -> None:
    """Exits unless --out's checkpoints are of this branch of --init-from (the same command
    again), as the run's recorded settings say."""
    settings = (recorded_settings.of_run_folder(args, quiet=True) or (None, {}))[1]
    recorded = settings.get("init_from") if settings.get("branch") else None
    origin, held = os.path.abspath(args.init_from), f"{plan.directory}/{plan.tag}"
    holds = f"--branch: --out {args.out} holds"
    if recorded is None:
        fail(f"{holds} checkpoints of a run that is not a branch ({held}); a decay branch starts "
             "in a folder of its own: give another --out")
    if recorded != origin:
        fail(f"{holds} the branch of {recorded} ({held}), not of {origin}; give this branch "
             f"another --out (--init-from {recorded} goes on with that one)")


def check_branch(plan: InitPlan, ds_config: dict, steps: int, allow: bool) -> InitPlan:
    """The plan, naming a change of rate at the branch; exits unless the branch trains past its
    checkpoint's step and decays after it, or on a rise of the rate unless `allow`."""
    scheduler = ds_config.get("scheduler", {})
    decay = scheduler.get("params", {}).get("decay_num_steps")
    if steps <= plan.step:
        fail(f"--branch from step {plan.step}: --steps {steps} leaves nothing to train; give "
             f"--steps {plan.step} + the steps of the branch")
    if decay is not None and steps - decay < plan.step:
        fail(f"--branch from step {plan.step}: --steps {steps} with --decay-steps {decay} starts "
             f"the decay at step {steps - decay}, before the checkpoint's; use --steps "
             f"{plan.step + decay} (or fewer --decay-steps)")
    last, first = schedule.branch_rates(manifest.read(plan.step_dir).get("lr_schedule"),
                                        plan.step, scheduler)  # none: nan
    if not schedule.rates_differ(first, last):
        return plan
    change = (f"--branch from step {plan.step}: its last step ran at learning rate {last:.4g}, "
              f"this schedule's first (step {plan.step + 1}) at {first:.4g}")
    if first > last and not allow:
        fail(f"{change}: the rate would warm back up (its run was already decaying). Branch from "
             "a checkpoint of the stable phase, or add --allow-training-changes to go on so")
    return dataclasses.replace(plan, changes=(*plan.changes, f"tupe-pretrain: {change}"))
