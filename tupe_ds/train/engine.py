"""The model this rank trains and its DeepSpeed engine, built from the run's configuration.

build_model makes the objective's model (or, with --pp > 1, this rank's pipeline stages) from the
run's seed; build_engine hands it to DeepSpeed with its parameter groups, scheduler, mpu and
optimizer boundary, and pairs the engine with its steps (steps.py)."""

import deepspeed
import torch

from tupe_ds.distributed.parallel import MegatronMPU, seed_tensor_parallel_rng
from tupe_ds.model.pipeline import BertPipeline, pipeline_topology
from tupe_ds.train import optimizer_boundary
from tupe_ds.train.checkpoint import reshard
from tupe_ds.train.config import RunConfig
from tupe_ds.train.normalization import LossNormalization
from tupe_ds.train.optim import parameter_groups
from tupe_ds.train.schedule import client_scheduler
from tupe_ds.train.steps import EngineSteps, PipelineLoss, PipelineSteps


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
                           "micro_batch.settled(run, model, ...) first")
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
