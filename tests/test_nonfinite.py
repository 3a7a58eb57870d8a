"""The non-finite guard (tupe_ds/train/nonfinite.py) and the finite-weights check before a save
(tupe_ds/train/checkpoint/save.py) on real DeepSpeed engines, one process: each optimizer class
DeepSpeed wraps a model in, driven into real overflows. (A faked `loss_scaler` once hid that
stage 0 keeps its fp16 scaler elsewhere.)"""

import math

import pytest
import torch

from one_process import deepspeed_group  # noqa: F401  (a fixture)
from tupe_ds.train import nonfinite
from tupe_ds.train.steps import release
from tupe_ds.train.checkpoint.save import weights_are_finite

CPU = torch.device("cpu")
STEM = "resume from it with a lower --lr (or more --warmup-steps) and --allow-training-changes, " \
       "or --resume-from an earlier checkpoint"


class Loss:
    """The output's mean square, times `factor`: math.inf makes a loss that is not finite."""
    factor = 1.0

    def __call__(self, output, labels=None):
        return output.float().pow(2).mean() * self.factor


@pytest.fixture
def build(deepspeed_group, monkeypatch):
    """build(precision, stage, pipeline=False, **settings): a real engine, destroyed after the
    test."""
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed refuses fp16 where the CPU lacks mkldnn's fp16 (cpu_accelerator.py
    # is_fp16_supported); torch's CPU kernels run these small fp16 layers all the same.
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    engines = []

    def make(*args, **kwargs):
        engines.append(new_engine(deepspeed_group, *args, **kwargs))
        return engines[-1]

    yield make
    while engines:  # pytest holds on to `make` (and so `engines`) after the test
        release(engines.pop())


def new_engine(deepspeed, precision, stage, pipeline=False, **settings):
    """On two small Linear layers; fp16 with dynamic scaling from 4 (2^2) down to 1, hysteresis
    2 (DeepSpeed's default); `settings` go into the config."""
    from deepspeed.pipe import PipelineModule

    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 2,
                          "min_loss_scale": 1, "hysteresis": 2}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    for key, value in settings.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    torch.manual_seed(0)
    loss = Loss()
    layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)]
    model = (PipelineModule(layers, num_stages=1, loss_fn=loss) if pipeline
             else torch.nn.Sequential(*layers))
    built, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    built.test_loss = loss
    return built


def step(engine, kind):
    """One optimizer step: '.' finite, 'x' its loss not finite, 'g' one gradient element NaN."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    first = next(engine.module.parameters())
    x = torch.ones(2, 4, dtype=first.dtype)
    engine.test_loss.factor = math.inf if kind == "x" else 1.0

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad

    hook = first.register_hook(poison) if kind == "g" else None
    if isinstance(engine, PipelineEngine):
        engine.train_batch(iter([(x, torch.zeros(2, 1))]))
    else:
        engine.backward(engine.test_loss(engine(x)))
        engine.step()
    if hook is not None:
        hook.remove()


def drive(engine, guard, plan):
    """The steps of `plan`; per step what the guard made of it ('.' applied, 's' skipped by the
    fp16 scaler's search, uncounted, a digit: counted, so many in a row) and the loss scale."""
    made, scales = "", []
    for number, kind in enumerate(plan, 1):
        skipped = engine.skipped_steps
        step(engine, kind)
        assert engine.skipped_steps == skipped + (kind != "."), (number, kind)  # DeepSpeed's
        said = guard.after_step(number)
        made += "." if kind == "." else (str(guard.in_a_row) if said else "s")
        scales.append(nonfinite.loss_scale(engine.optimizer))
    return made, scales


def use_fp16_optimizer(monkeypatch):
    """DeepSpeed puts FP16_Optimizer around its own FusedAdam only (engine.py
    _configure_fp16_optimizer), on a CPU a C++ extension compiled at first use (~40 s); torch's
    AdamW passes for it here: FP16_Optimizer.step hands its inner optimizer flat fp32 gradients
    either way, and its loss scaling does not depend on it."""
    import deepspeed.runtime.engine

    monkeypatch.setattr(deepspeed.runtime.engine, "FusedAdam", torch.optim.AdamW)


# ZeRO's DynamicLossScaler honours hysteresis 2: the first overflow only uses it up, the scale
# stays. Stage 0's optimizers ignore hysteresis and halve the scale at every overflow.
FP16_DYNAMIC = {
    "stage 0 fused": (0, "FP16_Optimizer", ".xxxx", ".ss12", [4, 2, 1, 1, 1]),
    "stage 0 unfused": (0, "FP16_UnfusedOptimizer", ".xxxx", ".ss12", [4, 2, 1, 1, 1]),
    "zero 1": (1, "DeepSpeedZeroOptimizer", ".xxxxx", ".sss12", [4, 4, 2, 1, 1, 1]),
    "zero 2": (2, "DeepSpeedZeroOptimizer", ".xxgxx", ".sss12", [4, 4, 2, 1, 1, 1]),
    "zero 3": (3, "DeepSpeedZeroOptimizer_Stage3", ".xxxxx", ".sss12", [4, 4, 2, 1, 1, 1]),
}


@pytest.mark.parametrize("case", FP16_DYNAMIC)
def test_fp16_skips_count_only_once_the_loss_scale_was_at_its_minimum(case, build,
                                                                       monkeypatch):
    """The scaler's search skips (4 -> 2 -> 1, the last one ending at the minimum included) do
    not count; from the minimum on every skip does, and the limit stops the run where DeepSpeed
    (ZeRO) would have raised an exception."""
    stage, optimizer, plan, made, scales = FP16_DYNAMIC[case]
    if optimizer == "FP16_Optimizer":
        use_fp16_optimizer(monkeypatch)
    engine = build("fp16", stage)
    assert type(engine.optimizer).__name__ == optimizer
    assert nonfinite.scaler_state(engine.optimizer) == (4, 1)
    guard = nonfinite.NonFiniteGuard(engine, limit=2)
    if stage > 0:
        assert engine.optimizer.loss_scaler.raise_error_at_min_scale is False  # the guard stops
    assert drive(engine, guard, plan[:-1]) == (made[:-1], scales[:-1]) and not guard.exhausted
    assert drive(engine, guard, plan[-1]) == (made[-1], scales[-1:]) and guard.exhausted
    assert guard.state() == {"in_a_row": 2, "total": 2}
    resumed = nonfinite.NonFiniteGuard(engine, limit=1)  # built at the minimum, as on a resume
    assert drive(engine, resumed, "x") == ("1", [1]) and resumed.exhausted


NO_DYNAMIC_SCALER = {  # precision, stage, settings, optimizer, loss scale
    "bf16 stage 0": ("bf16", 0, {}, "FP16_UnfusedOptimizer", None),
    "bf16 zero 1, fp32 gradients": ("bf16", 1, {"data_types": {"grad_accum_dtype": "fp32"}},
                                    "BF16_Optimizer", None),
    "bf16 zero 2": ("bf16", 2, {}, "DeepSpeedZeroOptimizer", None),
    "fp32 zero 2": ("fp32", 2, {}, "DeepSpeedZeroOptimizer", None),
    "fp16 static stage 0": ("fp16", 0, {"fp16": {"loss_scale": 128}}, "FP16_UnfusedOptimizer",
                            128),
    "fp16 static zero 2": ("fp16", 2, {"fp16": {"loss_scale": 128}}, "DeepSpeedZeroOptimizer",
                           128),
}


@pytest.mark.parametrize("case", NO_DYNAMIC_SCALER)
@pytest.mark.slow
def test_without_a_dynamic_loss_scaler_every_skip_counts(case, build):
    precision, stage, settings, optimizer, scale = NO_DYNAMIC_SCALER[case]
    engine = build(precision, stage, **settings)
    assert type(engine.optimizer).__name__ == optimizer
    guard = nonfinite.NonFiniteGuard(engine, limit=2)
    assert drive(engine, guard, "x.g") == ("1.1", [scale] * 3) and not guard.exhausted
    assert drive(engine, guard, "x") == ("2", [scale]) and guard.exhausted
    assert guard.state() == {"in_a_row": 2, "total": 3}
    said = guard.stop_message(4, "step2")
    assert said.startswith("stopping at step 4: 2 steps in a row had a loss or gradient")
    assert f"Last good checkpoint: step2. To go on, {STEM};" in said
    assert said.endswith("the data of steps 3-4 is where to look")
    assert "bf16" not in said  # a resume refuses another precision
    assert "No checkpoint was written yet. To go on, run again with a lower --lr" in \
        guard.stop_message(4, None)  # nothing to resume: a new start takes any --lr


PIPELINE = {  # precision, stage, optimizer, plan, what the guard makes of it
    "fp16 stage 0": ("fp16", 0, "FP16_UnfusedOptimizer", ".xxxx", ".ss12"),
    "fp16 zero 1": ("fp16", 1, "DeepSpeedZeroOptimizer", ".xxxxx", ".sss12"),
    "bf16 stage 0": ("bf16", 0, "BF16_Optimizer", "x.xx", "1.12"),
}


@pytest.mark.parametrize("case", PIPELINE)
def test_the_pipeline_engine_s_skips_count_the_same_way(case, build):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    precision, stage, optimizer, plan, made = PIPELINE[case]
    engine = build(precision, stage, pipeline=True)
    assert isinstance(engine, PipelineEngine) and type(engine.optimizer).__name__ == optimizer
    guard = nonfinite.NonFiniteGuard(engine, limit=2)
    assert drive(engine, guard, plan)[0] == made and guard.exhausted


@pytest.mark.parametrize("stage", [2, 3])
def test_weights_are_finite_checks_what_each_rank_holds(stage, build):
    """Under ZeRO-3 a parameter is an empty placeholder between uses and the rank holds its
    shard (`ds_tensor`): checking the parameters checked nothing."""
    # ZeRO-3 keeps small parameters whole by default; none here
    whole = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    engine = build("fp16", stage, zero_optimization=whole)
    step(engine, ".")
    assert weights_are_finite(engine, CPU)
    param = list(engine.module.parameters())[-1]
    with torch.no_grad():
        (param.ds_tensor if stage == 3 else param).view(-1)[-1] = math.nan
    assert not weights_are_finite(engine, CPU)
    if stage == 3:
        assert all(p.numel() == 0 for p in engine.module.parameters())
        assert all(torch.isfinite(p).all() for p in engine.module.parameters())  # the old check
