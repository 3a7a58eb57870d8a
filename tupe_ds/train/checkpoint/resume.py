"""Which checkpoint a run starts from, checked twice: before any process starts (`plan_resume`,
`plan_init`: manifests, identity and layout, from config.load), then by every rank (`choose`:
the files verified, with a fallback) before the engine is built and the state loaded (`load`,
`init_from`)."""

import os
import uuid
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import identity, manifest, reshard
from tupe_ds.train.checkpoint.rng import derive_rng_state, file_name, load_rng_state
from tupe_ds.train.waits import announced


@dataclass(frozen=True)
class ResumePlan:
    """What a run resumes, decided before any process starts."""
    directory: str  # OUT/checkpoints
    candidates: tuple  # steps, newest first: the one to resume, then its lineage's older ones
    resharding: Optional[reshard.Reshard]  # how candidates[0] loads on this layout
    by_hand: bool  # --resume-from: that one or none
    verified: bool = True  # False: written by an earlier tupe_ds, without a manifest

    @property
    def tag(self) -> str:
        return folders.tag_of(self.candidates[0])


@dataclass(frozen=True)
class InitPlan:
    """--init-from: the weights (and, with --init-optimizer, Adam's state) of another run's
    checkpoint, in a new run."""
    step_dir: str
    with_optimizer: bool


def describe_steps(steps: List[int]) -> str:
    return ", ".join(folders.tag_of(s) for s in steps)


def plan_resume(out: str, resume: str, resume_from: Optional[str], world_size: int, tp: int,
                pp: int, zero_stage: int) -> Optional[ResumePlan]:
    """What --out holds to resume (None: nothing, a fresh start); ValueError saying what to do
    when it cannot be resumed on this layout, or when --resume never meets checkpoints."""
    directory = os.path.join(out, "checkpoints")
    complete = folders.complete_steps(directory)
    legacy = folders.legacy_step(directory)
    if resume == "never":
        if complete or legacy:
            newest = folders.tag_of((complete or [legacy])[-1])
            raise ValueError(
                f"--resume never, and it holds checkpoints of a run "
                f"({describe_steps(complete or [legacy])}): nothing is overwritten. To continue "
                f"that run leave out --resume never; to start over give another --out; to "
                f"start a new run from its weights, --out NEW --init-from "
                f"{os.path.join(directory, newest)}")
        return None
    verified = legacy is None
    if resume_from is not None:
        step = folders.step_of(os.path.basename(resume_from.rstrip("/")))
        if step not in complete and step != legacy:
            held = describe_steps(complete) or "none"
            raise ValueError(f"--resume-from {resume_from}: {directory}/{folders.tag_of(step)} "
                             f"is not a complete checkpoint (no manifest.json); complete ones: "
                             f"{held}")
        candidates, by_hand = (step,), True
    elif complete:
        lineage = manifest.read(os.path.join(directory, folders.tag_of(complete[-1]))).get(
            "lineage")
        candidates = tuple(s for s in reversed(complete) if manifest.read(
            os.path.join(directory, folders.tag_of(s))).get("lineage") == lineage)
        by_hand = False
    elif legacy:
        candidates, by_hand = (legacy,), False
    else:
        return None
    resharding = plan_layout(directory, candidates[0], world_size, tp, pp, zero_stage)
    return ResumePlan(directory, candidates, resharding, by_hand, verified)


def plan_layout(directory: str, step: int, world_size: int, tp: int, pp: int,
                zero_stage: int) -> Optional[reshard.Reshard]:
    """How checkpoint `step` loads on this layout (reshard.plan)."""
    tag = folders.tag_of(step)
    saved = reshard.read_saved_layout(directory, tag)
    if saved is None:
        return None
    return reshard.plan(tag, saved, world_size, tp, pp, zero_stage,
                        reshard.has_zero_shards(os.path.join(directory, tag)))


def refuse_another_run(plan: ResumePlan, current: dict) -> None:
    """ValueError naming every difference between the checkpoint's identity and this run's."""
    if not plan.verified:
        return  # an earlier version recorded none
    step_dir = os.path.join(plan.directory, plan.tag)
    differences = identity.differences(manifest.read(step_dir)["identity"], current)
    if differences:
        raise ValueError(
            f"{step_dir} is another run than this command's: "
            + "; ".join(differences) + ". Resume it with its own settings; to change them "
            f"deliberately, start a new run from it: --out NEW --init-from {step_dir}")


def plan_init(init_from: str, with_optimizer: bool, current: dict, world_size: int, tp: int,
              pp: int, zero_stage: int) -> InitPlan:
    """--init-from CHECKPOINT (a stepN folder, or a run's folder or checkpoints folder for its
    newest complete one), checked: complete, the same vocabulary and the same parameters (the
    sequence length, dropout and precision may change), a layout it loads on."""
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
    changeable = {"seq_length", "hidden_dropout", "attention_dropout", "dtype"}
    differences = identity.differences(
        {"vocabulary": saved["identity"]["vocabulary"], "models": [
            {k: v for k, v in m.items() if k not in changeable} for m in
            saved["identity"]["models"]]},
        {"vocabulary": current["vocabulary"], "models": [
            {k: v for k, v in m.items() if k not in changeable} for m in current["models"]]})
    if differences:
        raise ValueError(f"--init-from {path}: its model is not this run's: "
                         + "; ".join(differences))
    layout = reshard.SavedLayout(**saved["layout"])
    dp = world_size // (tp * pp)
    if (layout.tp, layout.pp) != (tp, pp):
        raise ValueError(f"--init-from {path}: written with --tp {layout.tp} --pp {layout.pp}; "
                         "its weights load with the same --tp and --pp")
    if with_optimizer and (layout.dp != dp or (layout.zero_stage == 0) != (zero_stage == 0)):
        raise ValueError(f"--init-optimizer: {path} was written by {layout} with ZeRO stage "
                         f"{layout.zero_stage}; its optimizer state loads on that layout "
                         f"({layout.world_size} processes) and ZeRO stage only")
    return InitPlan(path, with_optimizer)


def verify(step_dir: str) -> List[str]:
    """Collective: the problems of the checkpoint's files (manifest.check_files), each rank
    checking a share of them; the same list on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        files = manifest.read(step_dir)["files"]
        names = sorted(files)[rank::world]
        problems = manifest.check_files(step_dir, {n: files[n] for n in names})
    except ValueError as error:
        problems = [str(error)]
    every_rank = [None] * world
    with announced(f"every rank to verify its share of {step_dir}", rank):
        dist.all_gather_object(every_rank, problems)
    return sorted({p for problems in every_rank for p in problems})


def choose(plan: ResumePlan, world_size: int, tp: int, pp: int, zero_stage: int,
           say) -> ResumePlan:
    """Collective: the first of the plan's candidates whose files verify, as a plan of its own;
    what failed is said file by file, and every step folder newer than the one chosen (failed,
    incomplete, or beyond --resume-from) is set aside. RuntimeError when none verifies."""
    failed = []
    if not plan.verified:
        say(f"tupe-pretrain: checkpoint {plan.tag} was written by an earlier tupe_ds, without a "
            "manifest: resumed unverified; its next checkpoints have one")
    for step in plan.candidates:
        step_dir = os.path.join(plan.directory, folders.tag_of(step))
        problems = verify(step_dir) if plan.verified else []
        if not problems:
            break
        say(f"tupe-pretrain: checkpoint {folders.tag_of(step)} failed verification: "
            + "; ".join(problems))
        failed.append(step)
        if plan.by_hand:
            raise RuntimeError(f"--resume-from {folders.tag_of(step)}: the checkpoint does not "
                               "verify (above); restore its files or choose another")
    else:
        raise RuntimeError(f"no checkpoint of {plan.directory} verifies ({describe_steps(failed)}"
                           " above); restore their files, or start a new run in another --out")
    chosen = plan
    if failed:
        try:
            resharding = plan_layout(plan.directory, step, world_size, tp, pp, zero_stage)
        except ValueError as error:
            raise RuntimeError(f"falling back to {folders.tag_of(step)}: {error}") from None
        chosen = ResumePlan(plan.directory, plan.candidates[len(failed):], resharding,
                            plan.by_hand)
        say(f"tupe-pretrain: resuming from {chosen.tag}, the previous complete checkpoint")
    if dist.get_rank() == 0:
        newer = [s for s in folders.step_folders(plan.directory) if s > step]
        said = folders.set_aside(plan.directory, newer, f"newer than {chosen.tag}, the "
                                 "checkpoint resumed: failed, incomplete or left by --resume-from")
        if said:
            print(said, flush=True)
    with announced(f"rank 0 to set aside the folders newer than {chosen.tag}", dist.get_rank()):
        dist.barrier()
    return chosen


def lineage_of(plan: Optional[ResumePlan]) -> str:
    """The lineage the run's checkpoints belong to: the resumed checkpoint's, or a new one."""
    if plan is not None and plan.verified:
        lineage = manifest.read(os.path.join(plan.directory, plan.tag)).get("lineage")
        if lineage:
            return lineage
    return uuid.uuid4().hex


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
    path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if path is None:
        raise RuntimeError(f"{load_dir}/{tag}: DeepSpeed could not load this checkpoint")
    if resharding is not None and resharding.convert:
        place_optimizer_state(engine)
    if resharding is None:
        load_rng_state(os.path.join(directory, tag, file_name(rank)))
    else:  # the old ranks' streams belong to the old layout
        derive_rng_state(seed, client_state["step"], parallel_state.get_data_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(),
                         parallel_state.get_tensor_model_parallel_rank())
    return client_state


def init_from(engine, plan: InitPlan, say) -> None:
    """Collective: the checkpoint's weights (and optimizer state) into a new run's engine, once
    its files verify; the new run keeps its own schedule, data stream and step count."""
    problems = verify(plan.step_dir)
    if problems:
        raise RuntimeError(f"--init-from {plan.step_dir} does not verify: " + "; ".join(problems))
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


def place_optimizer_state(engine) -> None:
    """A universal load sets Adam's step as a CPU tensor, where torch's fused AdamW (the shipped
    configs') keeps it on the parameters' device; torch's own load_state_dict puts every state
    where its optimizer wants it (not measured on a GPU yet: on a CPU the two places are one)."""
    optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's, under ZeRO's wrapper
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(optimizer.state_dict())
