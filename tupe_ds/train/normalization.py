"""--loss-normalization: what the summed token losses of a step are divided by.

per-token (the default): the step's global count of the tokens each loss term is over (masked
tokens for the masked-LM loss, real tokens for ELECTRA's discriminator), whatever the micro-batch
x accumulation x dp split, so that a run keeps its objective when its layout changes; the counts
are known on the host before the step's first forward and all-reduced over the data-parallel
ranks once a step. micro-batch: each micro-batch's own mean, averaged over the step's
micro-batches and ranks, as BERT's and ELECTRA's original code did. docs/pretraining.md, "Loss
normalisation", says why per-token is the default. Validation divides per token in both modes,
over the same samples whatever the layout.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tupe_ds.distributed.parallel import to_device

PER_TOKEN, MICRO_BATCH = "per-token", "micro-batch"
MODES = (PER_TOKEN, MICRO_BATCH)


class LossNormalization:
    """The loss denominators of a step's (or a validation's) micro-batches, for `objective`
    (its `token_counts(batch)`: one count per loss term, read on the host)."""

    def __init__(self, mode: str, objective, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"loss normalization {mode!r}: choose one of {', '.join(MODES)}")
        self.mode, self.objective, self.device = mode, objective, device

    def divisors(self, micro_batches: list, per_token: bool) -> tuple:
        """(denominators, share) for `micro_batches` (this rank's share of a step or of a
        validation; every data-parallel rank calls it with as many): what each loss term's token
        sum is divided by in them (None where each micro-batch divides by its own counts: the
        micro-batch mode, when not `per_token`), and the share of the step's objective that one
        micro-batch's loss is (1 / (micro-batches x dp), see objectives.py).

        DeepSpeed divides each micro-batch's loss by the accumulation steps (engine.backward,
        which the pipeline engine's last stage calls too) and averages the gradients over the
        data-parallel ranks (ZeRO's reduction, or the engine's all-reduce without ZeRO). Dividing
        by count / (micro-batches x dp) rather than by the count makes what DeepSpeed computes
        exactly the step's sum / count, and switches none of its scaling off: every ZeRO stage,
        the pipeline engine and the fp16 loss scaler (applied after) run as they are, and the
        loss they see keeps the size of a micro-batch mean."""
        contributions = len(micro_batches) * parallel_state.get_data_parallel_world_size()
        if not per_token and self.mode == MICRO_BATCH:
            return None, 1 / contributions
        counts = torch.tensor([self.objective.token_counts(batch) for batch in micro_batches],
                              dtype=torch.int64).sum(0)
        counts = to_device(counts, self.device)
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        return counts.clamp(min=1).to(torch.float32) / contributions, 1 / contributions
