"""The training loop of tupe-pretrain (tupe_ds/pretrain.py parses and checks the configuration):
process groups, engine, data, resume, then steps with logging, validation, positional images and
checkpoints until --steps or a stop signal."""

import dataclasses
import os
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from tupe_ds.data import blend
from tupe_ds.data.blend import BlendedSamples
from tupe_ds.data.loader import MaskedSamples, TrainBatches, Vocabulary, valid_batches
from tupe_ds.data.packing import PackedSentences
from tupe_ds.data.prefetch import made_ahead
from tupe_ds.distributed.parallel import (MegatronMPU, accelerator_device, seed_tensor_parallel_rng,
                                          share_cpu_cores, start_distributed)
from tupe_ds.machine import doctor
from tupe_ds.machine.cuda_arch import fit_cuda_arch_list
from tupe_ds.machine.extension_locks import extension_locks, extensions_root, lock_text
from tupe_ds.model.pipeline import BertPipeline, pipeline_topology
from tupe_ds.train import (auto_micro_batch, optimizer_boundary, precision, recorded_settings,
                           run_description, run_lock)
from tupe_ds.train.batch_ramp import BatchRamp
from tupe_ds.train.checkpoint import folder as checkpoint_folder
from tupe_ds.train.checkpoint import manifest, reshard, resume, safe_load
from tupe_ds.train.checkpoint.save import NonFiniteWeights, SaveFailed, on_rank_0, save
from tupe_ds.train.config import RunConfig
from tupe_ds.train.flags import Refused, TrainingStopped
from tupe_ds.train.monitor import Monitor, run_flops_per_step
from tupe_ds.train.nonfinite import NonFiniteGuard, loss_scale
from tupe_ds.train.normalization import LossNormalization
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.optim import (apply_config, loaded_differences, parameter_groups,
                                  rate_from_schedule)
from tupe_ds.train.schedule import client_scheduler, follow_step, schedule_text
from tupe_ds.train.steps import EngineSteps, PipelineLoss, PipelineSteps
from tupe_ds.train.stop_signal import StopSignal
from tupe_ds.train.waits import announced


def datasets(run: RunConfig, vocab: Vocabulary, objective) -> dict:
    """"train": the stream of --data (the blend of its sources; one source is its own stream),
    "valid": each source's valid samples, in --data's order. Global rank 0 opens the datasets
    first, building the sample indexes that are missing, while the other ranks wait at a
    barrier, then map them: the index cache's file lock alone would let every node build at once
    on a filesystem whose locks hold per node (NFS with local_lock, BeeGFS, Lustre's
    localflock)."""
    def open_sources():
        return [{split: PackedSentences(os.path.join(source.folder, split), run.seq_len,
                                        vocab.cls, vocab.sep, source.index_cache)
                 for split in ("train", "valid")} for source in run.sources]

    def stream(packed):
        return MaskedSamples(packed, vocab, run.masking, run.seed, run.vectorised_stream,
                             objective.generator_draws)

    first = dist.get_rank() == 0
    packed = open_sources() if first else None
    dist.barrier()
    if not first:
        packed = open_sources()
    return {"train": BlendedSamples([stream(p["train"]) for p in packed],
                                    [source.weight for source in run.sources]),
            "valid": [stream(p["valid"]) for p in packed]}


def reads_data(run: RunConfig) -> bool:
    """Whether this rank's steps read batches (a pipeline's middle stages do not)."""
    return run.layout.pp == 1 or parallel_state.is_pipeline_first_stage() \
        or parallel_state.is_pipeline_last_stage()


def evaluate(steps, valid: list, run: RunConfig, micro_batch: int, device) -> dict:
    """The objective's metrics over the first --eval-samples valid samples of each source (the
    same ones in every layout), as valid/NAME; for a blend also each source's, as
    valid/SOURCE/NAME, and valid/NAME is their mean weighted as the blend is."""
    dp, rank = run.dp_size, parallel_state.get_data_parallel_rank()
    per_source = []
    for samples in valid:
        totals = {}
        with made_ahead(valid_batches(samples, micro_batch, rank, dp, run.eval_samples),
                        run.prefetch if reads_data(run) else 0,
                        pin=device.type != "cpu") as batches:
            steps.evaluate(batches, totals)
        per_source.append(steps.reduce(totals))
    if len(per_source) == 1:
        return {f"valid/{name}": value for name, value in per_source[0].items()}
    weights = blend.shares(run.sources)
    blended = {f"valid/{name}": sum(weight * own[name] for weight, own in zip(weights, per_source))
               for name in per_source[0]}
    for source, own in zip(run.sources, per_source):
        blended.update({f"valid/{source.name}/{name}": value for name, value in own.items()})
    return blended


def write_run_description(run: RunConfig, lineage: str, plan=None) -> None:
    """OUT/run.json: the models, layout and lineage of the run, the checkpoint it resumed (its
    newest now; `plan` None: a start from step 0) and the --resume-from it applied
    (run_description.py)."""
    batch = run.ds_config["train_batch_size"]
    description = {"objective": run.objective, "lineage": lineage,
                   "data": os.path.abspath(run.data),
                   "sources": [{"folder": os.path.abspath(source.folder), "weight": source.weight,
                                "name": source.name} for source in run.sources],
                   "tp": run.layout.tp, "pp": run.layout.pp, "steps": run.steps,
                   "global_batch": batch, "seq_len": run.seq_len,
                   "masking": dataclasses.asdict(run.masking),
                   "rampup_batch_size": str(run.batch_split.ramp) if run.batch_split.ramp
                   else None,
                   "lr_schedule": run.ds_config.get("scheduler"),
                   "branched_from": run.branch_origin or run_description.branched_from(run.out),
                   "flops_per_step": run_flops_per_step(run.models, batch, run.seq_len),
                   "micro_batch": {"size": run.batch_split.micro_batch,  # auto_micro_batch.py
                                   "auto": run.batch_split.auto},  # reads it at the next start
                   "models": [dataclasses.asdict(config) for config in run.models],
                   run_description.NEWEST_CHECKPOINT: plan.candidates[0] if plan else None,
                   run_description.RESUME_FROM: resume_from_record(plan, run.out),
                   recorded_settings.FIELD: run.settings}
    run_description.write(run.out, description)


def resume_from_record(plan, out: str) -> Optional[dict]:
    """What OUT/run.json is to record of --resume-from (run_description.resume_from_record):
    anew when this start applies the flag, the last start's when it resumes otherwise (a
    requeued attempt, the flag applied earlier), none for a run that starts anew."""
    if plan is None:
        return None
    if plan.by_hand:
        return {"step": plan.candidates[0], "written": []}
    return run_description.resume_from_record(out)


def build_model(run: RunConfig, objective):
    """The model this rank trains, from the run's seed: the objective's, or for --pp > 1 this
    rank's pipeline stages (BertPipeline)."""
    torch.manual_seed(run.seed)  # weights, and dropout alike on every tensor-parallel rank
    seed_tensor_parallel_rng(run.seed)  # each tensor-parallel rank's heads: its own dropout
    layout = run.layout
    if layout.pp > 1:
        topology = pipeline_topology(layout.pp, layout.tp, layout.dp)
        return BertPipeline(run.models[0], topology, PipelineLoss(objective))
    model = objective.build(run.models)
    model.universal_checkpoint_info = reshard.universal_info(model)  # saved by DeepSpeed
    return model


def build_engine(run: RunConfig, objective, device, model=None):
    """The model (build_model's unless given), its DeepSpeed engine and its steps."""
    if run.batch_split.micro_batch is None:  # DeepSpeed must never read "auto"
        raise RuntimeError("--micro-batch auto is chosen before the engine is built: "
                           "auto_micro_batch.settled(run, model, ...) first")
    model = build_model(run, objective) if model is None else model
    normalization = LossNormalization(run.loss_normalization, objective, device)
    weight_decay = run.ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    config, lr_scheduler = client_scheduler(run.ds_config)
    pipeline = run.layout.pp > 1  # the pipeline's grid is its mpu
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, weight_decay), config=config,
        lr_scheduler=lr_scheduler, mpu=None if pipeline else MegatronMPU())
    optimizer_boundary.install(engine.optimizer, run.optimizer_boundary)
    if pipeline:
        return model, engine, PipelineSteps(engine, model.loss_fn, normalization, device)
    ramped = run.batch_split.ramp is not None
    return model, engine, EngineSteps(engine, objective, normalization, device, ramped)


def saved_layout(run: RunConfig, engine) -> reshard.SavedLayout:
    """This run's layout, as its checkpoints record it."""
    return reshard.SavedLayout(
        world_size=run.world_size, tp=run.layout.tp, pp=run.layout.pp, dp=run.layout.dp,
        zero_stage=engine.zero_optimization_stage(),
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation=engine.gradient_accumulation_steps(),
        vocab_size=run.models[0].vocab_size)


def chosen_training_changes(plan, run: RunConfig) -> list:
    """How the checkpoint chosen (a fallback too) was trained otherwise, to say and apply;
    Refused when the run may not change that (resume.training_changes)."""
    if plan is None or not plan.verified:
        return []
    try:
        return resume.training_changes(os.path.join(plan.directory, plan.tag), run.training,
                                       run.allow_training_changes)
    except ValueError as error:
        raise Refused(str(error)) from None


def unrecorded_training_changes(plan, run: RunConfig, engine) -> list:
    """For a checkpoint that does not record its training settings (an earlier tupe_ds): how
    the optimizer state it restored differs from the config, read from the state itself; Refused
    as resume.training_changes would."""
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


def waiting_with_extensions(what: str):
    """A wait during which DeepSpeed may also build or load an extension: its text, with the
    state of every build lock at the time it is printed."""
    def text() -> str:
        locks = [lock_text(*lock) for lock in extension_locks()]
        return (f"{what} (DeepSpeed may be building an extension in {extensions_root()})"
                + "".join(f"; {lock}" for lock in locks))
    return text


def started_by(world_size: int, launcher: str) -> str:
    return ("1 process, no launcher" if launcher == "single process"
            else f"{world_size} processes from {launcher}")


def rendezvous_text(world_size: int) -> str:
    if world_size == 1:
        return "the process group of this one process"
    return (f"the rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT): every process of the "
            "run must start")


def train(run: RunConfig, launcher: str) -> None:
    """Every process of the run calls it: trains from the latest checkpoint to --steps."""
    stop = StopSignal()  # SIGUSR1 from the start: Slurm's warning may come while the run starts
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per process
    device = accelerator_device()
    if device.type == "cpu":
        share_cpu_cores()
    backend = "gloo" if device.type == "cpu" else get_accelerator().communication_backend_name()
    rank = int(os.environ.get("RANK", "0"))
    with announced(waiting_with_extensions(rendezvous_text(run.world_size)), rank):
        start_distributed(backend)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=run.layout.tp,
                                                 pipeline_model_parallel_size=run.layout.pp)
    os.makedirs(run.out, exist_ok=True)
    say = print if rank == 0 else (lambda *a, **k: None)
    run_lock.confirm_on_every_rank(run.lock, run.out)
    dtype = doctor.precision(run.ds_config)
    advice = dtype == "fp16" and precision.bf16_advice(precision.every_rank_machine(), dtype)
    if advice:
        say(advice, flush=True)
    layout = run.layout
    # rank 0's plan, verified by every rank before the engine is built for it
    plan = resume.choose(run.resume_plan, layout.world_size, layout.tp, layout.pp,
                         run.ds_config.get("zero_optimization", {}).get("stage", 0),
                         lambda line: say(line, flush=True))
    changes = chosen_training_changes(plan, run)
    if plan is None and run.init_plan is not None:
        resume.check_init(run.init_plan)
    convert = plan is not None and plan.resharding is not None and plan.resharding.convert
    run.ds_config.setdefault("checkpoint", {})["load_universal"] = convert
    lineage = resume.lineage_of(plan, run.out)

    arch_note = fit_cuda_arch_list()
    if arch_note and rank == 0:
        print(f"tupe-pretrain: {arch_note}", flush=True)
    objective = OBJECTIVES[run.objective]
    with announced(waiting_with_extensions("the DeepSpeed engine of every rank"), rank):
        model = build_model(run, objective)
        run = auto_micro_batch.settled(run, model, objective, device)  # the last run.json's
        model, engine, steps = build_engine(run, objective, device, model)
    if run.lock is not None and engine.monitor.enabled:
        run.lock.guard(engine.monitor)
    kept = run.optimizer_boundary == "foreach" and optimizer_boundary.unsupported(engine.optimizer)
    if kept:
        say(f"tupe-pretrain: the foreach optimizer boundary does not apply ({kept}): DeepSpeed's "
            "own overflow check and norm", flush=True)
    if rank == 0:  # with the micro-batch chosen
        damage = run_description.damage(run.out)
        if damage:
            say(f"tupe-pretrain: {damage}: written anew", flush=True)
        write_run_description(run, lineage, plan)
    vocab = Vocabulary.from_data_dir(run.data)
    folders = ", ".join(source.folder for source in run.sources)
    with announced(f"the sample indexes of {folders} (seq-len {run.seq_len})", rank):
        data = datasets(run, vocab, objective)
    checkpoints = os.path.join(run.out, "checkpoints")
    state = resume.load(engine, plan, run.seed) if plan is not None else None
    if state is not None:
        rate_from_schedule(engine)
    if state is not None and not resume.records_training(plan):
        changes = unrecorded_training_changes(plan, run, engine)
    if changes:
        apply_config(engine, run.ds_config)
        for line in changes:
            say(line, flush=True)
    branched = state is None and run.init_plan is not None and run.init_plan.branch
    if branched:
        state = resume.branch_from(engine, run.init_plan)
        apply_config(engine, run.ds_config)  # the branch's schedule from its first step
        for line in run.init_plan.changes:
            say(line, flush=True)
    elif state is None and run.init_plan is not None:
        resume.init_from(engine, run.init_plan, lambda line: say(line, flush=True))
    step = state["step"] if state else 0
    micro_batch = engine.train_micro_batch_size_per_gpu()
    ramp = run.batch_split.ramp
    batches = TrainBatches(data["train"], micro_batch, engine.gradient_accumulation_steps(),
                           parallel_state.get_data_parallel_rank(), run.layout.dp,
                           consumed=state["consumed"] if state else 0,
                           prefetch=run.prefetch if reads_data(run) else 0,
                           pin=device.type != "cpu",
                           ramp=BatchRamp(ramp, run.batch_split.global_batch, micro_batch,
                                          run.layout.dp) if ramp else None)
    layout = saved_layout(run, engine)
    record = {"lineage": lineage, "identity": run.identity,  # for the manifests
              "training": run.training, "resumed_from": plan.tag if plan else None,
              "resume_from_applied": resume.applied_tag(plan),
              "init_from": run.init_plan.step_dir if run.init_plan else None,
              "software": safe_load.software_versions(),  # what a resume can load: safe_load
              "lr_schedule": run.ds_config.get("scheduler")}  # its steps ran under: a --branch
    guard = NonFiniteGuard(engine, run.max_nonfinite_steps,
                           state.get("nonfinite") if state else None)
    last_checkpoint = plan.tag if plan else None
    monitor = Monitor(run.out, run.models, run.seq_len, run.world_size, rank,
                      resumed_at=step, times=state.get("times") if state else None,
                      settings={"train/mask_rate": run.masking.probability,
                                "train/mask_split/mask": run.masking.mask,
                                "train/mask_split/random": run.masking.random}, lock=run.lock,
                      steps=run.steps, device=device, precision=dtype)
    start = ("resumed at" if plan else f"branched from {run.init_plan.step_dir} at" if branched
             else "starting")
    say(f"{start} step {step} of {run.steps}: {run.objective} "
        f"{run.model} {run.models[0].pos_encoding}, {started_by(run.world_size, launcher)} "
        f"({run.layout}), {run.batch_split}, samples of {run.seq_len} tokens, loss normalised "
        f"{run.loss_normalization}, {run.masking}, learning rate "
        f"{schedule_text(run.ds_config)}, {data['train'].description(run.sources)}", flush=True)

    metrics, totals, failure, everywhere = {}, {}, None, True
    logged_from = batches.consumed  # the first global sample of the logging interval
    stop.listen_for_sigterm()
    stopped_early = stop.any_rank()
    if stopped_early:  # nothing trained since the checkpoint resumed: nothing to save
        say(f"stopping before step {step + 1} on {stopped_early}; run the same command to "
            "continue", flush=True)
    monitor.start()
    while step < run.steps and not stopped_early:
        if ramp:
            engine.set_train_batch_size(batches.global_batch)
        follow_step(engine.lr_scheduler, step + 1)
        lr, global_batch = engine.get_lr()[0], batches.global_batch  # this step's
        steps.train(batches.next_step(), totals)
        step += 1
        said = guard.after_step(step)
        if said:
            say(said, flush=True)
        if guard.exhausted:
            monitor.scalars(step, {"train/nonfinite_steps": guard.total})
            failure = guard.stop_message(step, last_checkpoint)
            break
        if step % run.intervals.log == 0 or step == run.steps:
            scale = loss_scale(engine.optimizer)
            say(monitor.train(step, steps.reduce(totals), lr, engine.get_global_grad_norm(),
                              scale, guard.total, batches.consumed - logged_from, global_batch,
                              engine.skipped_steps), flush=True)
            if len(run.sources) > 1:
                monitor.scalars(step, data["train"].shares(run.sources, logged_from,
                                                           batches.consumed - logged_from))
            totals, logged_from = {}, batches.consumed
        if step % run.intervals.eval == 0 or step == run.steps:
            with monitor.timing("evaluation"):
                metrics = evaluate(steps, data["valid"], run,
                                   engine.train_micro_batch_size_per_gpu(), device)
            monitor.scalars(step, {**metrics,
                                   "time/evaluation_seconds": monitor.seconds["evaluation"]})
            say(f"step {step} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        has_images = run.models[0].encoding.has_positional_logits
        if has_images and (step % run.intervals.image == 0 or step == run.steps):
            with monitor.timing("evaluation"):
                for tag, encoder in objective.encoders(model).items():
                    scores = encoder.positional_scores(min(run.seq_len, 128))
                    monitor.positional_images(step, tag, scores)
        stopping = stop.any_rank()
        if step % run.intervals.save == 0 or step == run.steps or stopping:
            failure = run_lock.lost_on_rank_0(run.lock)
            if failure:
                break
            client_state = {"step": step, "consumed": batches.consumed,
                            "nonfinite": guard.state(), "times": monitor.times()}
            try:
                with monitor.timing("checkpoint"):
                    save(engine, checkpoints, step, client_state, run.keep_checkpoints, layout,
                         record, device, lock=run.lock)
                    on_rank_0(lambda: run_description.record_written(run.out, step),
                              f"could not record checkpoint step{step} in {run.out}/run.json",
                              rank, f"rank 0 to record checkpoint step{step} in run.json")
            except NonFiniteWeights as error:
                failure = f"{error}; the last good checkpoint is {last_checkpoint or 'none'}"
                break
            except SaveFailed as error:  # a full disk, a folder in the way: the previous stand
                tag = checkpoint_folder.tag_of(step)
                if manifest.exists(os.path.join(checkpoints, tag)):  # failed after its manifest
                    last_checkpoint = tag
                failure = (f"{error}; the last complete checkpoint is "
                           f"{last_checkpoint or 'none'}. Free space (or mend the folder) and "
                           "run the same command: it resumes from there")
                everywhere = error.everywhere
                break
            last_checkpoint = checkpoint_folder.tag_of(step)
            monitor.saved(step)
        if stopping:
            say(f"stopping at step {step} on {stopping}; "
                "run the same command to continue", flush=True)
            break
    if failure is not None and not everywhere:  # the other ranks wait in a collective
        raise TrainingStopped(failure, everywhere=False)
    if failure is None and not metrics and not stopped_early:  # report where the run stands
        metrics = evaluate(steps, data["valid"], run, engine.train_micro_batch_size_per_gpu(),
                           device)
    monitor.close()
    batches.close()
    steps.close()
    if failure is not None:
        raise TrainingStopped(failure)
    if stopped_early:
        return
    say(monitor.summary(step, metrics["valid/loss"], last_checkpoint))
