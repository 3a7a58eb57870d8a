"""One optimizer step, and one evaluation, on DeepSpeed's engine or on its pipeline engine.

`train` and `evaluate` take this rank's micro-batches, divide their losses as the run's
LossNormalization says (normalization.py), and add the objective's metrics to `totals` as
(sum, count) pairs (see objectives.py); `reduce` sums them over data-parallel ranks and returns
name -> sum / count on every rank.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.profiler import record_function

from tupe_ds.distributed.parallel import gather_tensor_parallel, to_device
from tupe_ds.model.layers import labelled_positions, masked_lm_loss
from tupe_ds.train.normalization import LossNormalization
from tupe_ds.train.objectives import add


def reduce_metrics(totals: dict, device) -> dict:
    """Sum the (sum, count) totals over data-parallel ranks; name -> sum / count."""
    if not totals:
        return {}
    names = sorted(totals)
    stacked = torch.stack([totals[name].to(device) for name in names])
    dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
    return {name: (pair[0] / pair[1].clamp(min=1e-30)).item() for name, pair in zip(names, stacked)}


class EngineSteps:
    """The whole model on every rank (tensor and data parallelism, any ZeRO stage)."""

    def __init__(self, engine, objective, normalization: LossNormalization, device,
                 ramped: bool = False):
        self.engine, self.objective, self.device = engine, objective, device
        self.normalization = normalization
        # DeepSpeed finds the accumulation boundary from its count of micro-steps modulo the
        # accumulation steps, which a batch ramp changes between steps: a ramp sets it
        self.ramped = ramped

    def _forward(self, batch, denominators):
        # What depends on the data is read on the host copy: no device synchronisation.
        padded = not batch["attention_mask"].all()
        batch = {**batch, "labelled": labelled_positions(batch["labels"])}
        batch = {k: to_device(v, self.device) for k, v in batch.items()}
        mask = batch["attention_mask"] if padded else None  # None: no mask for the kernels at all
        loss, output = self.objective.forward(self.engine, batch, mask, denominators)
        return batch, loss, output

    def train(self, micro_batches, totals: dict) -> None:
        """The phases are named for torch.profiler (`step/...`): bench/gpu/step_time.py times them."""
        micro_batches = list(micro_batches)
        denominators, share = self.normalization.divisors(micro_batches, per_token=False)
        for index, batch in enumerate(micro_batches):
            if self.ramped:
                self.engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            with record_function("step/forward"):
                batch, loss, output = self._forward(batch, denominators)
            with record_function("step/backward"):  # with ZeRO's gradient reduction
                self.engine.backward(loss)
            with record_function("step/optimizer"):  # at the accumulation boundary
                self.engine.step()
            with record_function("step/metrics"):
                add(totals, self.objective.metrics(batch, loss, output, share))

    def evaluate(self, micro_batches, totals: dict) -> None:
        micro_batches = list(micro_batches)
        denominators, share = self.normalization.divisors(micro_batches, per_token=True)
        self.engine.eval()
        with torch.no_grad():
            for batch in micro_batches:
                batch, loss, output = self._forward(batch, denominators)
                add(totals, self.objective.metrics(batch, loss, output, share))
        self.engine.train()

    def reduce(self, totals: dict) -> dict:
        return reduce_metrics(totals, self.device)

    def close(self) -> None:
        release(self.engine)


class PipelineLoss:
    """The last stage's loss_fn: masked-LM loss on this rank's vocabulary shard, divided by
    `denominators` (set for each step; None: the micro-batch's own count); it adds the
    objective's metrics of each micro-batch to `totals`, each loss weighing `share` of the step."""

    def __init__(self, objective):
        self.objective = objective
        self.totals, self.denominators, self.share = {}, None, 1.0

    def __call__(self, logits, labels):
        """logits [n, b, vocab / tp], labels [b, n]."""
        denominator = None if self.denominators is None else self.denominators[0]
        loss = masked_lm_loss(logits, labels.t(), denominator)
        full_logits = gather_tensor_parallel(logits.detach(), dim=-1).transpose(0, 1)
        add(self.totals, self.objective.metrics({"labels": labels}, loss, full_logits, self.share))
        return loss


class PipelineSteps:
    """DeepSpeed's pipeline engine: stage 0 reads the inputs, the last stage the labels, and the
    engine schedules the micro-batches through the stages."""

    def __init__(self, engine, loss: PipelineLoss, normalization: LossNormalization, device):
        self.engine, self.loss, self.device = engine, loss, device
        self.normalization = normalization

    def _pipeline_batches(self, micro_batches, totals: dict, per_token: bool):
        """`micro_batches` as the engine takes them, ((input_ids, attention_mask), labels), with
        the last stage's loss_fn set for them (only that stage reads the labels)."""
        self.loss.totals = totals
        if self.engine.is_last_stage():
            micro_batches = list(micro_batches)
            self.loss.denominators, self.loss.share = self.normalization.divisors(micro_batches,
                                                                                  per_token)
        return (((batch["input_ids"], batch["attention_mask"]), batch["labels"])
                for batch in micro_batches)

    def train(self, micro_batches, totals: dict) -> None:
        self.engine.train_batch(self._pipeline_batches(micro_batches, totals, per_token=False))

    def evaluate(self, micro_batches, totals: dict) -> None:
        micro_batches = list(micro_batches)
        self.engine.eval_batch(self._pipeline_batches(micro_batches, totals, per_token=True),
                               num_micro_batches=len(micro_batches))

    def reduce(self, totals: dict) -> dict:
        """Only the last stage has metrics: reduced there, then sent to the other stages."""
        last = self.engine.is_last_stage()
        metrics = [reduce_metrics(totals, self.device) if last else None]
        dist.broadcast_object_list(metrics, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return metrics[0]

    def close(self) -> None:
        release(self.engine)


def release(engine) -> None:
    """Let the engine go, and with it its process groups (their gloo threads, which abort a
    process that exits with them alive: end_distributed): engine.destroy() drops its gradient
    hooks; DeepSpeed 0.19 still holds a ZeRO-3 engine's module in FWD_MODULE_STACK and in a
    class-wide lru_cache, and a pipeline engine its last loss and buffers, whose activations
    carry backward hooks that refer to it (a cycle through autograd the garbage collector cannot
    see)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator

    for buffers in getattr(engine, "pipe_buffers", {}).values():
        buffers.clear()
    if hasattr(engine, "pipe_buffers"):
        engine.loss = None
    engine.destroy()
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [module for module in stack if module is not engine.module]
    cached = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in cached.__closure__ or ():  # an nvtx wrapper around the lru_cache
        getattr(cell.cell_contents, "cache_clear", lambda: None)()
