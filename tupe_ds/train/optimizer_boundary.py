"""The optimizer step's boundary on DeepSpeed's ZeRO stage 1/2 optimizer: the overflow check and
the gradient norm from one pass of `torch._foreach_norm`, read to the host once a step.

DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.step) checks each
gradient tensor for inf/NaN and takes each one's norm apart: 11 operators per gradient tensor
(BERT-Large has 303) and, with 2 parameter groups, 4 host reads a step, each waiting for the
device to drain its queue (docs/pretraining.md, "The optimizer boundary and bf16"). torch's
GradScaler and clip_grad_norm_ do the same with one foreach pass and one read.

Here (`--optimizer-boundary foreach`, the default) one `torch._foreach_norm` pass gives the norm
(`scaled_norm`), with DeepSpeed's parameter groups, exclusions and process groups, and one read.
A gradient with inf or NaN makes that norm non-finite, and DeepSpeed counts a non-finite norm as
an overflow in fp16, fp32 and (with `check_grad_overflow`, its default) bf16: the read decides
the overflow, and DeepSpeed gets the norm as a 0-dim tensor in host memory, so that its own
checks of it (`is_invalid_grad_norm`) and its clipping (`unscale_and_clip_grads`) read no device
memory. Everything else in the step stays DeepSpeed's: the skip, the loss scaler's update
(hysteresis), clipping, `engine.skipped_steps`, `get_global_grad_norm()`. The norm's sum of
squares is fp32 where DeepSpeed's is fp64: the norms agree to fp32 rounding, and both overflow
where the sum of squares passes fp32's range (DeepSpeed casts it to fp32).

Installed on the optimizer instance (its `check_overflow` and `scaled_global_norm`, the seam its
`step` calls): DeepSpeed builds the optimizer inside `deepspeed.initialize` from the config, so a
subclass could only take its place through a copy of that function, and an instance attribute
leaves the class, and every other engine in the process, as they are. Only DeepSpeedZeroOptimizer
itself; every other optimizer class and setting keeps DeepSpeed's own path (`unsupported` says
why). `--optimizer-boundary deepspeed` keeps it everywhere: the reference
(tests/test_optimizer_boundary.py compares the two).
"""

import math
import weakref
from typing import Optional

import torch
from deepspeed import comm as dist
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

# What the boundary's check and norm cost in one step, fp16 and bf16 alike (2 parameter groups,
# ZeRO 1, measured on the CPU 2026-11-27; tests/test_optimizer_boundary.py and
# tests/test_step_syncs.py check them): here, aten operators (whatever the number of gradient
# tensors) and reads that wait for the device; DeepSpeed's own, operators per gradient tensor
# and reads (one fewer in fp32, which checks no overflow).
FOREACH_OPERATORS, FOREACH_WAITS = 15, 1
DEEPSPEED_OPERATORS_PER_TENSOR, DEEPSPEED_WAITS = 11, 4
BOUNDARIES = {
    "foreach": f"the overflow check and the gradient norm from one torch._foreach_norm pass and "
               f"{FOREACH_WAITS} host read a step (ZeRO 1-2; other optimizers keep DeepSpeed's)",
    "deepspeed": f"the reference: DeepSpeed's own check and norm ({DEEPSPEED_OPERATORS_PER_TENSOR} "
                 f"operators per gradient tensor, {DEEPSPEED_WAITS - 1}-{DEEPSPEED_WAITS} host "
                 "reads a step)",
}
DEFAULT = "foreach"


def unsupported(optimizer) -> Optional[str]:
    """Why the foreach boundary does not apply to `optimizer`, which then keeps DeepSpeed's own
    check and norm; None where it applies."""
    if type(optimizer) is not DeepSpeedZeroOptimizer:  # ZeRO-3, BF16_Optimizer, FP16_Optimizer..
        return f"{type(optimizer).__name__} is not DeepSpeedZeroOptimizer (ZeRO 1-2)"
    if optimizer.cpu_offload:  # its overflow flag is gathered while the gradients are copied
        return "optimizer offload"
    if optimizer.has_moe_layers:  # expert norms are averaged over their own groups
        return "MoE layers"
    if optimizer.torch_autocast_gradscaler is not None:
        return "torch autocast's GradScaler"
    if "muon" in type(optimizer.optimizer).__name__.lower():  # some groups scaled afterwards
        return "Muon"
    if not optimizer.compute_grad_norm:  # DeepSpeed checks inf/NaN only, without a norm
        return "zero_optimization.compute_grad_norm false"
    return None


def install(optimizer, boundary: str) -> bool:
    """Give `optimizer` the foreach boundary when `boundary` is "foreach" and it applies;
    whether it did."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"optimizer boundary {boundary!r}: one of {', '.join(BOUNDARIES)}")
    if boundary != "foreach" or unsupported(optimizer) is not None:
        return False
    foreach = ForeachBoundary(optimizer)
    optimizer.check_overflow = foreach.check_overflow
    optimizer.scaled_global_norm = foreach.scaled_global_norm
    return True


def host_norm(value: float) -> torch.Tensor:
    """The norm as DeepSpeed's step takes it (a float32 tensor), in host memory."""
    return torch.tensor(value, dtype=torch.float32)


class ForeachBoundary:
    """The two methods DeepSpeedZeroOptimizer.step calls for one optimizer: `check_overflow`
    (when it checks for overflow: fp16, bf16 by default) computes the norm and decides;
    `scaled_global_norm` hands that norm over, or computes it where no check ran (fp32)."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer):
        self.optimizer = weakref.proxy(optimizer)  # it holds these methods: no cycle
        self.checked = None  # the norm check_overflow read this step, for scaled_global_norm

    def check_overflow(self, partition_gradients=True):
        self.checked = scaled_norm(self.optimizer)
        self.optimizer.overflow = not math.isfinite(self.checked)

    def scaled_global_norm(self, norm_type=2):
        assert norm_type == 2, "only L2 norm supported"  # DeepSpeed's own assertion
        norm, self.checked = self.checked, None
        if norm is None:
            norm = scaled_norm(self.optimizer)
        # DeepSpeed's combined norm is inf wherever a group's was inf or NaN
        return host_norm(norm if math.isfinite(norm) else math.inf)


def scaled_norm(optimizer: DeepSpeedZeroOptimizer) -> float:
    """The L2 norm of the step's (loss-scaled) gradients over every rank, as DeepSpeed's
    `scaled_global_norm` adds them up, with one host read; not finite where a gradient
    (excluded ones too) holds inf or NaN on any rank.

    By hand around `torch._foreach_norm` because torch.nn.utils.get_total_norm takes an fp16
    gradient's norm in fp16 (inf for 32 elements of 6e4) and knows no process group, and
    megatron-core's get_grad_norm_fp32 runs on 'cuda' only and sums one list: the parameter
    groups, exclusions and process groups here are DeepSpeed's."""
    groups = [norm_terms(optimizer, optimizer.averaged_gradients[i],
                         optimizer.params_in_partition[i])
              for i in range(len(optimizer.bit16_groups))]
    tensors = [tensor for counted, excluded in groups for tensor in (*counted, *excluded)]
    # a rank whose partitions hold only padding has none (foreach ops refuse an empty list)
    norms = iter(torch._foreach_norm(tensors, 2, dtype=torch.float32) if tensors else ())
    sums = []
    for counted, excluded in groups:
        counted_norms = [next(norms) for _ in counted]
        total = (torch.stack(counted_norms).pow(2).sum() if counted_norms
                 else torch.zeros((), dtype=torch.float32, device=optimizer.device))
        if excluded:  # 0, or NaN where one of them is not finite
            total = total + torch.stack([next(norms) for _ in excluded]).mul(0).sum()
        sums.append(total)
    group_squares = torch.stack(sums)
    dist.all_reduce(group_squares, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    optimizer._model_parallel_all_reduce(tensor=group_squares, op=dist.ReduceOp.SUM)
    return torch.linalg.vector_norm(group_squares.sqrt()).item()  # the step's one host read


def norm_terms(optimizer: DeepSpeedZeroOptimizer, gradients, params) -> tuple:
    """(the gradients DeepSpeed's norm counts, the others it checks for overflow only), as
    get_grad_norm_direct and has_overflow_partitioned_grads_serial pick them."""
    counted, excluded = [], []
    unpadded = (g for g in gradients if not getattr(g, "_zero_padding", False))
    for gradient, param in zip(unpadded, params):
        replicated = hasattr(param, PIPE_REPLICATED) and param.ds_pipe_replicated
        if not replicated and (is_model_parallel_parameter(param)
                               or optimizer.model_parallel_rank == 0):
            counted.append(gradient)
        else:
            excluded.append(gradient)
    return counted, excluded
