"""The training loop of tupe-pretrain (tupe_ds/pretrain.py parses and checks the configuration):
train() takes a start through its steps, from the process groups to the summary at its end, and
step_loop trains, logs, validates, draws the positional images and saves checkpoints until
--steps or a stop signal."""

import dataclasses
import logging
import os
from typing import Optional, Union

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from tupe_ds.data.loader import TrainBatches
from tupe_ds.distributed.parallel import (accelerator_device, rendezvous_text, share_cpu_cores,
                                          start_distributed)
from tupe_ds.machine.cuda_arch import fit_cuda_arch_list
from tupe_ds.machine.extension_locks import waiting_with_extensions
from tupe_ds.model import compiled
from tupe_ds.tools.errors import TrainingStopped
from tupe_ds.train import micro_batch, optimizer_boundary, precision
from tupe_ds.train.checkpoint import folder as checkpoint_folder
from tupe_ds.train.checkpoint import manifest, resume
from tupe_ds.train.checkpoint.reshard import SavedLayout
from tupe_ds.train.checkpoint.save import (NonFiniteWeights, SaveFailed, checkpoint_record, save,
                                           saved_layout)
from tupe_ds.train.config import RunConfig
from tupe_ds.train.datasets import open_datasets, train_batches
from tupe_ds.train.engine import build_engine, build_model
from tupe_ds.train.monitor import Monitor, finished_summary
from tupe_ds.train.nonfinite import NonFiniteGuard, loss_scale
from tupe_ds.train.objectives import OBJECTIVES, Electra, MaskedLM
from tupe_ds.train.progress import start_line
from tupe_ds.train.run_folder import files as folder_files
from tupe_ds.train.run_folder import lock as folder_lock
from tupe_ds.train.run_folder.description import describe_run
from tupe_ds.train.schedule import follow_step
from tupe_ds.train.steps import EngineSteps, PipelineSteps
from tupe_ds.train.stop_signal import StopSignal, before_first_step
from tupe_ds.train.validation import evaluate
from tupe_ds.tools import log_lines
from tupe_ds.tools.waits import announced

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Training:
    """What train()'s steps build for the step loop, and what its checkpoints record."""
    objective: Union[MaskedLM, Electra]
    model: torch.nn.Module
    engine: DeepSpeedEngine  # its pipeline engine with --pp > 1
    steps: Union[EngineSteps, PipelineSteps]
    data: dict  # datasets(): the training stream and each source's valid samples
    batches: TrainBatches
    layout: SavedLayout
    record: dict  # save.checkpoint_record
    guard: NonFiniteGuard
    monitor: Monitor


@dataclasses.dataclass
class Outcome:
    """Where the step loop left the start."""
    step: int
    metrics: dict  # the last validation's, with its "step" ({}: none this start)
    last_checkpoint: Optional[str]  # the newest complete checkpoint's tag (None: none)
    failure: Optional[str] = None  # why the run stopped short (None: --steps or a stop signal)
    everywhere: bool = True  # whether every rank stops on the failure
    stopped_early: Optional[str] = None  # the stop signal heard before the first step


def train(run: RunConfig, launcher: str) -> None:
    """Every process of the run calls it: trains from the latest checkpoint to --steps."""
    stop = StopSignal()  # SIGUSR1, SIGINT from the start: they may come while the run starts
    device, rank = start_process_groups(run)
    os.makedirs(run.out, exist_ok=True)
    log_lines.show(rank)
    if any(model.compile_mode == "block" for model in run.models):
        compiled.keep_compiled_in(run.out)
    folder_lock.confirm_on_every_rank(run.lock, run.out)
    dtype = precision.of_run(run.ds_config)
    start = resume.agreed(run)
    if finished(run, start, rank):
        return
    objective = OBJECTIVES[run.objective]
    last_checkpoint = start.plan.tag if start.plan else None  # the newest intact one
    # DeepSpeed's monitor opens its events file inside the engine's build, on rank 0 alone
    folder_files.on_every_rank(lambda: folder_files.takes_writes(run.out) if rank == 0 else None,
                            "write", run.out, last_checkpoint, "rank 0 to write in the run folder")
    run, model, engine, steps = built_engine(run, objective, device, rank)
    folder_files.on_every_rank(lambda: describe_run(run, start.lineage) if rank == 0 else None,
                            "write", os.path.join(run.out, "run.json"), last_checkpoint,
                            "rank 0 to write run.json")  # with the micro-batch chosen
    data = open_datasets(run, objective, rank, last_checkpoint)
    state, branched = resume.load_or_initialise(run, engine, start)
    step = state["step"] if state else 0
    batches = train_batches(run, data["train"], engine, state, device)
    if state and "tokens_seen" not in state:  # a checkpoint of a tupe_ds before they were counted
        logger.info(f"tupe-pretrain: counting the tokens of the {batches.consumed:,} samples "
                    "trained before, from the data's index (about a second a million samples)")
    monitor = Monitor(run.out, run.models, run.seq_len, run.world_size, rank,
                      resumed_at=step, times=state.get("times") if state else None,
                      settings={"train/mask_rate": run.masking.probability,
                                "train/mask_split/mask": run.masking.mask,
                                "train/mask_split/random": run.masking.random}, lock=run.lock,
                      steps=run.steps, device=device, precision=dtype,
                      tokens_seen=batches.tokens_seen())
    if engine.monitor.enabled:  # DeepSpeed's own writes fail as the monitor's do
        monitor.watch(engine.monitor)
    training = Training(
        objective, model, engine, steps, data, batches,
        layout=saved_layout(run, engine),
        record=checkpoint_record(run, start.lineage, start.plan),
        guard=NonFiniteGuard(engine, run.max_nonfinite_steps,
                             state.get("nonfinite") if state else None),
        monitor=monitor)
    logger.info(start_line(run, step, start.plan, branched, launcher, data["train"]))
    outcome = step_loop(run, training, stop, step, last_checkpoint, device, rank)
    finish(run, training, outcome, device)


def finished(run: RunConfig, start: resume.Start, rank: int) -> bool:
    """Whether the run has trained its --steps already, as the checkpoint it resumes on its own
    layout says: then rank 0 says so and the summary its log holds, no engine built
    (Monitor.finished_summary). On another layout it loads as a resume does (its conversion
    checked)."""
    if start.plan is None or start.training_changes or start.plan.resharding is not None or \
            checkpoint_folder.step_of(start.plan.tag) != run.steps:
        return False
    said = [folder_files.on_every_rank(
        lambda: finished_summary(run.out, run.steps, start.plan.tag) if rank == 0 else None,
        "read", os.path.join(run.out, "train_log.jsonl"), start.plan.tag,
        "rank 0 to read the run's log")]
    torch.distributed.broadcast_object_list(said, src=0)  # every rank goes on, or none
    if said[0] is None:
        return False
    logger.info(f"resumed at step {run.steps} of {run.steps}: nothing to train (the run has "
                f"trained its --steps; a larger --steps trains on)\n{said[0]}")
    return True


def start_process_groups(run: RunConfig) -> tuple:
    """This process's device (one GPU per process) and global rank, with the run's process
    groups and its tensor-, pipeline- and data-parallel groups (megatron-core's) set up."""
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
    return device, rank


def built_engine(run: RunConfig, objective, device, rank: int) -> tuple:
    """The run (its micro-batch chosen: --micro-batch auto), the model, its DeepSpeed engine and
    its steps, built on every rank while DeepSpeed may build an extension."""
    arch_note = fit_cuda_arch_list()
    if arch_note:
        logger.info(f"tupe-pretrain: {arch_note}")
    with announced(waiting_with_extensions("the DeepSpeed engine of every rank"), rank):
        model = build_model(run, objective)
        run = micro_batch.settled(run, model, objective, device)  # the last run.json's
        model, engine, steps = build_engine(run, objective, device, model)
    kept = run.optimizer_boundary == "foreach" and optimizer_boundary.unsupported(engine.optimizer)
    if kept:
        logger.info(f"tupe-pretrain: the foreach optimizer boundary does not apply ({kept}): "
                    "DeepSpeed's own overflow check and norm")
    return run, model, engine, steps


def step_loop(run: RunConfig, training: Training, stop: StopSignal, step: int,
              last_checkpoint: Optional[str], device, rank: int) -> Outcome:
    """The steps after `step` until --steps or a stop signal: each trains, and at its intervals
    logs, validates, draws the positional images and saves a checkpoint. The run stops short
    on too many steps not finite (NonFiniteGuard), its folder taken over, a failed save, or a
    write of its log or TensorBoard events that failed (agreed at the start and at each log
    interval: run_folder/files.py)."""
    engine, batches, guard, monitor = (training.engine, training.batches, training.guard,
                                       training.monitor)
    metrics, totals = {}, {}
    logged_from = batches.consumed  # the first global sample of the logging interval
    failure = agreed_writes(training, last_checkpoint)  # the log opened, trimmed
    if failure:
        return Outcome(step, metrics, last_checkpoint, failure=failure)
    stop.listen_for_sigterm()
    stopped_early = stop.any_rank()
    if stopped_early:
        said, fails = before_first_step(stopped_early, step, last_checkpoint)
        if fails:
            return Outcome(step, metrics, last_checkpoint, failure=said)
        logger.info(said)
    monitor.start()
    while step < run.steps and not stopped_early:
        if run.batch_split.ramp:
            engine.set_train_batch_size(batches.global_batch)
        follow_step(engine.lr_scheduler, step + 1)
        lr, global_batch = engine.get_lr()[0], batches.global_batch  # this step's
        monitor.step_rate = lr  # DeepSpeed's monitor writes it at the step's end (Monitor.watch)
        training.steps.train(monitor.loading(batches.next_step()), totals)
        step += 1
        said = guard.after_step(step)
        if said:
            logger.info(said)
        if guard.exhausted:
            monitor.scalars(step, {"train/nonfinite_steps": guard.total})
            return Outcome(step, metrics, last_checkpoint,
                           failure=guard.stop_message(step, last_checkpoint))
        logged = step % run.intervals.log == 0 or step == run.steps
        if logged:
            log_progress(run, training, step, totals, lr, global_batch, logged_from)
            totals, logged_from = {}, batches.consumed
        if step % run.intervals.eval == 0 or step == run.steps:
            metrics = validate(run, training, step, device)
        has_images = run.models[0].encoding.has_positional_logits
        if has_images and (step % run.intervals.image == 0 or step == run.steps):
            draw_positional_images(run, training, step)
        failure = agreed_writes(training, last_checkpoint) if logged else None
        if failure:
            return Outcome(step, metrics, last_checkpoint, failure=failure)
        stopping = stop.any_rank()
        if step % run.intervals.save == 0 or step == run.steps or stopping:
            last_checkpoint, failure, everywhere = save_checkpoint(run, training, step,
                                                                   last_checkpoint, device, rank)
            if failure:
                return Outcome(step, metrics, last_checkpoint, failure, everywhere)
        if stopping:
            logger.info(f"stopping at step {step} on {stopping}; run the same command to continue")
            break
    return Outcome(step, metrics, last_checkpoint, stopped_early=stopped_early)


def agreed_writes(training: Training, last_checkpoint: Optional[str]) -> Optional[str]:
    """Collective: why every rank stops because rank 0 could not write the run's log or
    TensorBoard events since the last agreement (None: it wrote them)."""
    return folder_files.agreed(training.monitor.failure, last_checkpoint,
                            "rank 0 to write the run's log")


def log_progress(run: RunConfig, training: Training, step: int, totals: dict, lr: float,
                 global_batch: int, logged_from: int) -> None:
    """The progress line and scalars of the steps since the global sample `logged_from`
    (`totals` their metrics; `lr`, `global_batch` the last one's); for a blend, each source's
    share of their samples."""
    engine, batches, monitor = training.engine, training.batches, training.monitor
    scale = loss_scale(engine.optimizer)
    line = monitor.train(step, training.steps.reduce(totals), lr, engine.get_global_grad_norm(),
                         scale, training.guard.total, batches.consumed - logged_from,
                         global_batch, batches.tokens_seen(), engine.skipped_steps)
    logger.info(str(line), extra={"fit": line.fit})  # on a terminal, what fits its width
    if len(run.sources) > 1:
        monitor.scalars(step, training.data["train"].shares(run.sources, logged_from,
                                                            batches.consumed - logged_from))


def validate(run: RunConfig, training: Training, step: int, device) -> dict:
    """The valid metrics at `step` (validation.evaluate), logged and said, with their "step"."""
    monitor = training.monitor
    with monitor.timing("evaluation"):
        metrics = evaluate(training.steps, training.data["valid"], run,
                           training.engine.train_micro_batch_size_per_gpu(), device)
    monitor.scalars(step, {**metrics, "time/evaluation_seconds": monitor.seconds["evaluation"]})
    logger.info(f"step {step} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return {**metrics, "step": step}


def draw_positional_images(run: RunConfig, training: Training, step: int) -> None:
    """Each encoder's positional scores at `step`, as images (timed as evaluation)."""
    with training.monitor.timing("evaluation"):
        for tag, encoder in training.objective.encoders(training.model).items():
            scores = encoder.positional_scores(min(run.seq_len, 128))
            training.monitor.positional_images(step, tag, scores)


def save_checkpoint(run: RunConfig, training: Training, step: int,
                    last_checkpoint: Optional[str], device, rank: int) -> tuple:
    """Saves `step`'s checkpoint (which records it in the run's history). Returns the newest complete
    checkpoint's tag then, and why the run stops (its folder taken over, weights not finite,
    a failed save; None: saved) with whether every rank stops on it."""
    failure = folder_lock.lost_on_rank_0(run.lock)
    if failure:
        return last_checkpoint, failure, True
    monitor, checkpoints = training.monitor, os.path.join(run.out, "checkpoints")
    client_state = {"step": step, "consumed": training.batches.consumed,
                    "tokens_seen": training.batches.tokens_seen(),
                    "nonfinite": training.guard.state(), "times": monitor.times()}
    try:
        with monitor.timing("checkpoint"):
            save(training.engine, checkpoints, step, client_state, run.keep_checkpoints,
                 training.layout, training.record, device, lock=run.lock)
    except NonFiniteWeights as error:
        failure = f"{error}; the last good checkpoint is {last_checkpoint or 'none'}"
        return last_checkpoint, failure, True
    except SaveFailed as error:  # a full disk, a folder in the way: the previous stand
        tag = checkpoint_folder.tag_of(step)
        if manifest.exists(os.path.join(checkpoints, tag)):  # failed after its manifest
            last_checkpoint = tag
        failure = (f"{error}; the last complete checkpoint is "
                   f"{last_checkpoint or 'none'}. " + (error.remedy or "Free space (or mend the "
                                                       "folder) and run the same command: it "
                                                       "resumes from there"))
        return last_checkpoint, failure, error.everywhere
    last_checkpoint = checkpoint_folder.tag_of(step)
    monitor.saved(step)
    return last_checkpoint, None, True


def finish(run: RunConfig, training: Training, outcome: Outcome, device) -> None:
    """The end of a start: TrainingStopped for a failure; else, once its data, monitor and
    steps are closed, rank 0's summary (with a validation where the start made none)."""
    if outcome.failure is not None and not outcome.everywhere:  # the others wait in a collective
        raise TrainingStopped(outcome.failure, everywhere=False)
    metrics = outcome.metrics
    if outcome.failure is None and not metrics and not outcome.stopped_early:
        metrics = {**evaluate(training.steps, training.data["valid"], run,  # where it stands
                              training.engine.train_micro_batch_size_per_gpu(), device),
                   "step": outcome.step}
    training.monitor.close()
    if outcome.failure is None:  # the last log line, the save's, the events closed
        outcome.failure = agreed_writes(training, outcome.last_checkpoint)
    training.batches.close()
    training.steps.close()
    if outcome.failure is not None:
        raise TrainingStopped(outcome.failure)
    if outcome.stopped_early:
        return
    logger.info(training.monitor.summary(outcome.step, metrics["step"], metrics["valid/loss"],
                                         outcome.last_checkpoint))
    said = compiled.summary(training.model)
    if said:
        logger.info(f"tupe-pretrain: {said}")
