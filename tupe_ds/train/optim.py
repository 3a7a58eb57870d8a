"""What pretraining and fine-tuning optimize alike."""

import torch


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Weight decay on matrices only: no decay on biases, LayerNorms and other vectors."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
