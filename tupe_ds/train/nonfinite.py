"""Steps whose loss or gradient is not finite: not applied, counted, and a run that keeps making
them stops before it writes anything from them.

DeepSpeed skips such a step itself wherever it checks for overflow, with the check all-reduced
so that every rank skips the same step: ZeRO stages 1-3 in every precision (in bf16 through
`bf16.check_grad_overflow`, on by default), and the fp16 and bf16 optimizers of stage 0. A loss
that is not finite makes gradients that are not, so the same check catches it. Stage 0 in fp32
hands the gradients to torch's optimizer unchecked, and `config_problem` refuses it. tupe_ds
counts the skips (`engine.skipped_steps`) and stops after --max-nonfinite-steps in a row. In
fp16 the loss scaler skips steps as it finds its scale; those count only once the scale is at
its minimum, where DeepSpeed would raise an exception and tupe_ds stops instead with the step
and the last good checkpoint.
"""

from typing import Optional


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


class NonFiniteGuard:
    """Counts the steps DeepSpeed did not apply; `after_step` says so, `exhausted` is True once
    `limit` counted ones came in a row. Its state goes into the checkpoints."""

    def __init__(self, engine, limit: int, state: Optional[dict] = None):
        self.engine, self.limit = engine, limit
        state = state or {}
        self.in_a_row, self.total = state.get("in_a_row", 0), state.get("total", 0)
        self.seen = engine.skipped_steps
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if getattr(scaler, "raise_error_at_min_scale", False):
            scaler.raise_error_at_min_scale = False  # this guard stops the run instead

    def state(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def scaler_can_go_lower(self) -> bool:
        """fp16: the loss scaler still finds its scale (its skips are its way of doing so)."""
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        return bool(getattr(scaler, "dynamic", False) and self.engine.fp16_enabled()
                    and scaler.cur_scale > scaler.min_scale)

    def after_step(self, step: int) -> Optional[str]:
        """The line to say when step `step` was not applied and counts; None otherwise."""
        skipped = self.engine.skipped_steps > self.seen
        self.seen = self.engine.skipped_steps
        if not skipped:
            self.in_a_row = 0
            return None
        if self.scaler_can_go_lower():
            return None
        self.in_a_row += 1
        self.total += 1
        return (f"step {step}: loss or gradient not finite, the update was not applied "
                f"({self.in_a_row} in a row, {self.total} in this run; it stops after "
                f"{self.limit} in a row: --max-nonfinite-steps)")

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def stop_message(self, step: int, last_checkpoint: Optional[str]) -> str:
        last = last_checkpoint or "none yet"
        return (f"stopping at step {step}: {self.in_a_row} steps in a row had a loss or gradient "
                f"that is not finite (none was applied, and nothing was saved from them). Last "
                f"good checkpoint: {last}. Try resuming from it with a lower --lr (or more "
                f"--warmup-steps), bf16 instead of fp16, or --resume-from an earlier checkpoint; "
                f"the data of steps {step - self.in_a_row + 1}-{step} is where to look")
