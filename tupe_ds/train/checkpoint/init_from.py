"""A new run from another run's checkpoint: --init-from (its weights, with --init-optimizer
Adam's state too) and --branch (all of its state, the run going on from its step).

Planned before any process starts (`plan_init`, from config.load: complete, the same model, a
layout it loads on), verified by every rank before the engine is built (`check_init`), loaded
into the new run's engine (`init_from`, `branch_from`)."""

import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import identity, manifest, reshard
from tupe_ds.train.checkpoint.allowed_changes import init_differences, training_changes
from tupe_ds.train.checkpoint.choice import verify
from tupe_ds.train.checkpoint.loading import confirm_loaded, holds_schedule
from tupe_ds.train.checkpoint.rng import file_name, load_rng_state
from tupe_ds.train.flags import Refused


@dataclass(frozen=True)
class InitPlan:
    """--init-from: the weights (and, with --init-optimizer, Adam's state) of another run's
    checkpoint, in a new run; with --branch all of its state, the run going on from its step."""
    step_dir: str
    with_optimizer: bool
    branch: bool = False
    step: int = 0  # the checkpoint's
    changes: tuple = ()  # lines: how a branch's training settings differ from the checkpoint's


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
