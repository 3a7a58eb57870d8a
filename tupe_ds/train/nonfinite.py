"""Steps whose loss or gradient is not finite: not applied, counted, and a run that keeps making
them stops before it writes anything from them.

DeepSpeed skips such a step itself wherever it checks for overflow, on every rank alike (a loss
that is not finite makes gradients that are not); `config_problem` refuses the configs where it
does not (docs/reliability.md, "Steps that are not finite are not applied"). tupe_ds counts the
skips (`engine.skipped_steps`) and stops after --max-nonfinite-steps in a row, with the step and
the last good checkpoint. In fp16 a skip counts only when the loss scale was already at its
minimum before the step: a dynamic scaler skips steps as it finds its scale (65536, 32768, ...).
`scaler_state` reads the scaler wherever DeepSpeed keeps it: stage 0's FP16_Optimizer and
FP16_UnfusedOptimizer in `loss_scale_config` (every overflow halves the scale, down to the
minimum), ZeRO's optimizers in `loss_scaler` (a DynamicLossScaler: with `hysteresis` an overflow
may skip without lowering the scale, and at the minimum it raises an exception, which the guard
turns off to stop the run itself).
"""

from typing import NamedTuple, Optional

import torch


def config_problem(ds_config: dict, dtype: str) -> Optional[str]:
    """What in the DeepSpeed config would let a step that is not finite reach the weights."""
    zero = ds_config.get("zero_optimization", {})
    if dtype == "fp32" and zero.get("stage", 0) == 0:
        return ("ZeRO stage 0 in fp32: DeepSpeed hands the gradients to torch's optimizer "
                "without checking them, so one NaN would reach the weights; use --zero-stage 1 "
                "(on one process it holds the same memory)")
    if zero.get("compute_grad_norm") is False and dtype != "fp16":
        return ("zero_optimization.compute_grad_norm false: DeepSpeed then cannot see a "
                "gradient that is not finite; remove it")
    if dtype == "bf16" and ds_config.get("bf16", {}).get("check_grad_overflow") is False:
        return ("bf16.check_grad_overflow false: DeepSpeed would apply a step whose gradient is "
                "not finite; remove it")
    return None


class LossScale(NamedTuple):
    scale: float    # the scale of the next step
    minimum: float  # the lowest scale it can go to: its own scale when static


def scaler_state(optimizer) -> Optional[LossScale]:
    """The fp16 loss scaler of any DeepSpeed optimizer; None without one (bf16, fp32)."""
    config = getattr(optimizer, "loss_scale_config", None)  # stage 0: FP16_(Unfused)Optimizer
    if config is not None:
        if not config.use_grad_scaling:  # the same classes in bf16
            return None
        dynamic = config.dynamic_loss_scale
        return LossScale(config.cur_scale, config.min_loss_scale if dynamic else config.cur_scale)
    scaler = getattr(optimizer, "loss_scaler", None)  # ZeRO 1-3; a LossScaler of 1 in bf16/fp32
    if scaler is None or getattr(optimizer, "dtype", None) != torch.float16:
        return None  # also BF16_Optimizer and torch's own optimizers, which have none
    return LossScale(scaler.cur_scale, scaler.min_scale if scaler.dynamic else scaler.cur_scale)


def loss_scale(optimizer) -> Optional[float]:
    """The current fp16 loss scale (dynamic or static) of a DeepSpeed optimizer; None without."""
    state = scaler_state(optimizer)
    return None if state is None else state.scale


class NonFiniteGuard:
    """Counts the steps DeepSpeed did not apply, but not an fp16 scaler's search for its scale;
    `after_step` says so, `exhausted` is True once `limit` counted ones came in a row. Its state
    goes into the checkpoints. Build it after the checkpoint is loaded (ZeRO's loading replaces
    the loss scaler with the saved one)."""

    def __init__(self, engine, limit: int, state: Optional[dict] = None):
        self.engine, self.limit = engine, limit
        state = state or {}
        self.in_a_row, self.total = state.get("in_a_row", 0), state.get("total", 0)
        self.seen = engine.skipped_steps
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if getattr(scaler, "raise_error_at_min_scale", False):
            scaler.raise_error_at_min_scale = False  # this guard stops the run instead
        self.before = scaler_state(engine.optimizer)  # the loss scale the next step starts with

    def state(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def after_step(self, step: int) -> Optional[str]:
        """The line to say when step `step` was not applied and counts; None otherwise."""
        skipped = self.engine.skipped_steps > self.seen
        self.seen = self.engine.skipped_steps
        before, self.before = self.before, scaler_state(self.engine.optimizer)
        if not skipped:
            self.in_a_row = 0
            return None
        if before is not None and before.scale > before.minimum:
            return None  # the fp16 scaler finding its scale: it could still go lower
        self.in_a_row += 1
        self.total += 1
        return (f"step {step}: loss or gradient not finite, the update was not applied "
                f"({self.in_a_row} in a row, {self.total} in this run; it stops after "
                f"{self.limit} in a row: --max-nonfinite-steps)")

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def stop_message(self, step: int, last_checkpoint: Optional[str]) -> str:
        if last_checkpoint:
            advice = (f"Last good checkpoint: {last_checkpoint}. To go on, resume from it with a "
                      "lower --lr (or more --warmup-steps) and --allow-training-changes, or "
                      "--resume-from an earlier checkpoint")
        else:
            advice = ("No checkpoint was written yet. To go on, run again with a lower --lr (or "
                      "more --warmup-steps)")
        return (f"stopping at step {step}: {self.in_a_row} steps in a row had a loss or gradient "
                f"that is not finite (none was applied, and nothing was saved from them). "
                f"{advice}; the data of steps {step - self.in_a_row + 1}-{step} is where to look")
