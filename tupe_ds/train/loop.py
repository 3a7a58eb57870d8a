"""The training loop of tupe-pretrain (tupe_ds/pretrain.py parses and checks the configuration):
process groups, engine, data, resume, then steps with logging, validation, positional images and
checkpoints until --steps or a stop signal."""

import os

from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.distributed.parallel import accelerator_device, share_cpu_cores, start_distributed
from tupe_ds.machine import doctor
from tupe_ds.machine.cuda_arch import fit_cuda_arch_list
from tupe_ds.train import (auto_micro_batch, optimizer_boundary, precision, run_description,
                           run_lock)
from tupe_ds.train.batch_ramp import BatchRamp
from tupe_ds.train.checkpoint import folder as checkpoint_folder
from tupe_ds.train.checkpoint import (allowed_changes, choice, init_from, loading, manifest,
                                      resume, safe_load)
from tupe_ds.train.checkpoint.save import NonFiniteWeights, SaveFailed, on_rank_0, save
from tupe_ds.train.config import RunConfig
from tupe_ds.train.datasets import datasets, reads_data
from tupe_ds.train.engine import build_engine, build_model
from tupe_ds.train.flags import TrainingStopped
from tupe_ds.train.monitor import Monitor
from tupe_ds.train.nonfinite import NonFiniteGuard, loss_scale
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.optim import apply_config, rate_from_schedule
from tupe_ds.train.progress import started_by
from tupe_ds.train.schedule import follow_step, schedule_text
from tupe_ds.train.start_record import saved_layout, write_run_description
from tupe_ds.train.starting_point import chosen_training_changes, unrecorded_training_changes
from tupe_ds.train.stop_signal import StopSignal
from tupe_ds.train.validation import evaluate
from tupe_ds.train.waits import announced, rendezvous_text, waiting_with_extensions


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
    plan = choice.choose(run.resume_plan, layout.world_size, layout.tp, layout.pp,
                         run.ds_config.get("zero_optimization", {}).get("stage", 0),
                         lambda line: say(line, flush=True))
    changes = chosen_training_changes(plan, run)
    if plan is None and run.init_plan is not None:
        init_from.check_init(run.init_plan)
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
    state = loading.load(engine, plan, run.seed) if plan is not None else None
    if state is not None:
        rate_from_schedule(engine)
    if state is not None and not allowed_changes.records_training(plan):
        changes = unrecorded_training_changes(plan, run, engine)
    if changes:
        apply_config(engine, run.ds_config)
        for line in changes:
            say(line, flush=True)
    branched = state is None and run.init_plan is not None and run.init_plan.branch
    if branched:
        state = init_from.branch_from(engine, run.init_plan)
        apply_config(engine, run.ds_config)  # the branch's schedule from its first step
        for line in run.init_plan.changes:
            say(line, flush=True)
    elif state is None and run.init_plan is not None:
        init_from.init_from(engine, run.init_plan, lambda line: say(line, flush=True))
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
