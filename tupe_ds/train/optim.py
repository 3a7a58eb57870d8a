"""What pretraining and fine-tuning optimize alike."""

import torch


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Weight decay on matrices only: no decay on biases, LayerNorms and other vectors."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def apply_config(engine, ds_config: dict) -> None:
    """After a resume with changed optimizer settings (--allow-training-changes): DeepSpeed
    restores the checkpoint's parameter groups (betas, eps, weight decay, learning rate); they
    take the config's, and the learning rate the schedule's at the step resumed, so that the
    changes hold from the first step. Group 0 is the decayed one (parameter_groups)."""
    params = ds_config.get("optimizer", {}).get("params", {})
    groups = engine.optimizer.param_groups
    for index, group in enumerate(groups):
        if "betas" in params:
            group["betas"] = tuple(params["betas"])
        if "eps" in params:
            group["eps"] = params["eps"]
        if "weight_decay" in params:
            group["weight_decay"] = params["weight_decay"] if index == 0 else 0.0
    if engine.lr_scheduler is not None:
        rate_from_schedule(engine)
    elif "lr" in params:  # no schedule: the optimizer's own, constant
        for group in groups:
            group["lr"] = params["lr"]


def rate_from_schedule(engine) -> None:
    """After a checkpoint is loaded: the learning rate its parameter groups hold is the one its
    own schedule set after its last step; the next step runs with this run's schedule's rate at
    that step (another --steps moves a decay's end)."""
    if engine.lr_scheduler is not None:
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_lr()):
            group["lr"] = lr
