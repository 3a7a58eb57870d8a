"""The foreach optimizer boundary (tupe_ds/train/optimizer_boundary.py) against DeepSpeed's own
check and norm, on DeepSpeed's real engines in one process: fp16 (DeepSpeed's CPU accelerator
refuses it unless `is_fp16_supported` says yes: torch's CPU kernels run these small fp16 layers
all the same, as in test_nonfinite.py), bf16 and fp32, ZeRO 1 as shipped and 2. The same steps,
with gradients made inf, NaN, finite but huge, or beyond fp32's sum of squares, give the same
parameters, norms, loss scales and skipped steps; the boundary takes a fixed number of operators
whatever the number of gradient tensors, and one read that waits for the device a step.

Several ranks (the norm's all_reduce over data- and model-parallel groups, ZeRO's partitions,
the exclusions of replicated parameters): test_loss_normalization.py's layouts (dp 2, tp 2,
pp 2, fp32 ZeRO 1-2 with clipping, the foreach boundary by default) log the gradient norm of
every step and compare it, and the parameters, with one process's."""

import gc
import json
import math
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from host_reads import Counter, host_values, waits
from one_process import deepspeed_group  # noqa: F401  (a fixture)
from runs import ROOT
from tupe_ds.train import nonfinite, optimizer_boundary
from tupe_ds.train.optim import parameter_groups
from tupe_ds.train.steps import release

BOUNDARY_METHODS = ("check_overflow", "scaled_global_norm")


def shipped_config(precision: str, stage: int) -> dict:
    """ds_configs/bert_large_fp16.json's optimizer, clipping and ZeRO settings for a batch of 2
    in `precision`; fp16's dynamic scale from 2^8 with DeepSpeed's hysteresis 2, raised after 2
    steps without overflow, so that a few steps move it both ways."""
    with open(os.path.join(ROOT, "ds_configs", "bert_large_fp16.json")) as f:
        config = json.load(f)
    config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, steps_per_print=10**9)
    del config["scheduler"]
    config["zero_optimization"]["stage"] = stage
    config["fp16"].update(enabled=precision == "fp16", initial_scale_power=8,
                          loss_scale_window=2)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


@pytest.fixture
def build(deepspeed_group, monkeypatch):
    """build(precision, stage, boundary, layers=2): a real engine on `layers` Linear layers with
    the boundary installed as tupe-pretrain does; released after the test."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    engines = []

    def make(precision, stage, boundary, layers=2, **settings):
        config = shipped_config(precision, stage)
        for key, value in settings.items():
            config[key] = {**config.get(key, {}), **value}
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))
        engine, _, _, _ = deepspeed_group.initialize(
            model=model, model_parameters=parameter_groups(model, 0.01), config=config)
        engine.installed = optimizer_boundary.install(engine.optimizer, boundary)
        engines.append(engine)
        return engine

    yield make
    while engines:
        release(engines.pop())


HUGE = {"fp16": 6e4, "bf16": 1e18, "fp32": 1e18}  # finite, and so is their norm in fp32


def poison(kind: str, precision: str):
    """The first weight's gradient for a step of `kind`: '.' as computed, 'i' one element inf,
    'n' one NaN, 'h' every element HUGE (its fp16 norm would be inf, its fp32 norm is not), 'o'
    every element 1e30 (finite in bf16 and fp32, its sum of squares beyond fp32's range)."""
    def hook(grad):
        if kind in "ho":
            return torch.full_like(grad, HUGE[precision] if kind == "h" else 1e30)
        grad = grad.clone()
        grad.view(-1)[0] = math.inf if kind == "i" else math.nan
        return grad
    return hook


def step(engine, kind: str, number: int, precision: str) -> None:
    first = next(engine.module.parameters())
    hook = first.register_hook(poison(kind, precision)) if kind != "." else None
    x = torch.linspace(-1, 1, 16).view(2, 8).to(first.dtype) * number
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    if hook is not None:
        hook.remove()


def state(engine) -> dict:
    """What a step leaves that either path could change."""
    norm = engine.get_global_grad_norm()
    return {"skipped": engine.skipped_steps, "overflow": engine.optimizer.overflow,
            "scale": nonfinite.loss_scale(engine.optimizer),
            "hysteresis": getattr(engine.optimizer.loss_scaler, "cur_hysteresis", None),
            "norm": None if norm is None else float(norm),
            "weights": [p.detach().float().clone() for p in engine.module.parameters()],
            "master": [p.detach().clone()
                       for p in engine.optimizer.single_partition_of_fp32_groups]}


def assert_same(foreach: dict, reference: dict, where) -> None:
    for key in ("skipped", "overflow", "scale", "hysteresis"):
        assert foreach[key] == reference[key], (where, key)
    # DeepSpeed sums the squares in fp64, the foreach norm in fp32
    assert foreach["norm"] == pytest.approx(reference["norm"], rel=1e-6), where
    for key in ("weights", "master"):
        for mine, theirs in zip(foreach[key], reference[key]):
            torch.testing.assert_close(mine, theirs, msg=f"{where}: {key}")


PARITY = {  # precision, ZeRO stage, the steps (poison's kinds), how many DeepSpeed skips
    "fp16 zero 1": ("fp16", 1, "..h.i.n..i.hn..", 4),
    "fp16 zero 2": ("fp16", 2, "..hin..h", 2),
    "bf16 zero 1": ("bf16", 1, "..h.i.no..h", 3),
    "fp32 zero 1": ("fp32", 1, "..h.i.no..h", 3),
    "fp32 zero 2": ("fp32", 2, ".h.io.n.", 3),
}


@pytest.mark.parametrize("case", PARITY)
def test_the_foreach_boundary_steps_as_deepspeed_does(case, build):
    precision, stage, plan, skips = PARITY[case]
    reference = build(precision, stage, "deepspeed")
    foreach = build(precision, stage, "foreach")
    assert type(foreach.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    assert foreach.installed and not reference.installed
    scales = []
    for number, kind in enumerate(plan, 1):
        step(reference, kind, number, precision)
        step(foreach, kind, number, precision)
        expected = state(reference)
        assert_same(state(foreach), expected, (number, kind))
        assert expected["overflow"] == (kind in "ino"), (number, kind)  # the premise
        scales.append(expected["scale"])
    assert reference.skipped_steps == skips
    if precision == "fp16":  # the scaler went up and down
        changes = {(after > before) - (after < before) for before, after in zip(scales, scales[1:])}
        assert changes == {-1, 0, 1}, scales


def test_a_finite_huge_fp16_gradient_is_clipped_not_skipped(build):
    """Its norm in fp16 would be inf (6e4 x sqrt(64) > 65504); the step is applied, clipped."""
    engine = build("fp16", 1, "foreach")
    scale = nonfinite.loss_scale(engine.optimizer)
    step(engine, "h", 1, "fp16")
    assert engine.skipped_steps == 0
    assert float(engine.get_global_grad_norm()) * scale > 65504  # the norm DeepSpeed reports
    # is the unscaled one


def boundary_operators(engine, precision: str) -> int:
    """The aten operators that the optimizer's check and norm call themselves in one step (not
    those an operator calls: on a CPU `_foreach_norm` loops over vector_norm, on CUDA it is a
    few multi-tensor kernels)."""
    optimizer = engine.optimizer

    def ranged(name, method):
        def call(*args, **kwargs):
            with record_function(f"boundary/{name}"):
                return method(*args, **kwargs)
        return call

    for name in BOUNDARY_METHODS:
        setattr(optimizer, name, ranged(name, getattr(optimizer, name)))
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step(engine, ".", 1, precision)
    return sum(1 for event in profiled.events() if event.name.startswith("aten::")
               and event.cpu_parent is not None and event.cpu_parent.name.startswith("boundary/"))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_boundary_takes_a_fixed_number_of_operators(precision, build):
    """DeepSpeed's check and norm: 11 operators per gradient tensor and 41 more (2 parameter
    groups; measured 2026-11-27: 85 for 4 tensors, 217 for 16); the foreach boundary 15 whatever
    the number of tensors (4 of them make the host tensor DeepSpeed gets, on a GPU too). The
    numbers tupe-pretrain's bf16 line gives (tupe_ds/train/precision.py)."""
    counts = {(boundary, layers): boundary_operators(build(precision, 1, boundary, layers),
                                                     precision)
              for boundary in optimizer_boundary.BOUNDARIES for layers in (2, 8)}
    print(precision, counts)
    assert counts["foreach", 2] == counts["foreach", 8] == optimizer_boundary.FOREACH_OPERATORS
    tensors = {layers: 2 * layers for layers in (2, 8)}  # a weight and a bias each
    per_tensor = (counts["deepspeed", 8] - counts["deepspeed", 2]) / (tensors[8] - tensors[2])
    assert per_tensor == optimizer_boundary.DEEPSPEED_OPERATORS_PER_TENSOR, counts


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_one_read_waits_for_the_device_a_step(precision, build, monkeypatch):
    """DeepSpeed's path reads the device at its overflow flag (fp16, bf16), at the norm's check
    and in the clipping of each parameter group; the foreach boundary once, and DeepSpeed's
    checks then read the host norm it was given."""
    counter = Counter().install(monkeypatch)
    host_values(monkeypatch)
    found = {}
    for boundary in optimizer_boundary.BOUNDARIES:
        engine = build(precision, 1, boundary)
        # the engines built before it, collected now: their destroy() synchronizes, and the
        # collector running it within a counted step counted it (seen once, CI, 2026-12-02)
        gc.collect()
        for number in (1, 2):
            counter.take()
            step(engine, ".", number, precision)
            found[boundary, number] = waits(counter.take())
    mine = found["foreach", 2]
    assert [(read.what, read.where) for read in mine] == \
        [("item", "tupe_ds/train/optimizer_boundary.py:scaled_norm")]
    assert found["foreach", 1] == mine
    theirs = {read.where for read in found["deepspeed", 2]}
    assert "deepspeed/runtime/utils.py:is_invalid_grad_norm" in theirs
    # fp32 has no overflow check: only the norm's
    expected = optimizer_boundary.DEEPSPEED_WAITS - (precision == "fp32")
    assert len(found["deepspeed", 2]) == expected, found


UNSUPPORTED = {  # precision, stage, settings, DeepSpeed's optimizer
    "bf16 stage 0": ("bf16", 0, {}, "FP16_UnfusedOptimizer"),
    "bf16 zero 1, fp32 gradients": ("bf16", 1, {"data_types": {"grad_accum_dtype": "fp32"}},
                                    "BF16_Optimizer"),
    "fp16 zero 3": ("fp16", 3, {}, "DeepSpeedZeroOptimizer_Stage3"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
@pytest.mark.slow
def test_other_optimizers_keep_deepspeed_s_boundary(case, build):
    precision, stage, settings, optimizer = UNSUPPORTED[case]
    engine = build(precision, stage, "foreach", **settings)
    assert type(engine.optimizer).__name__ == optimizer
    assert not engine.installed
    assert optimizer in optimizer_boundary.unsupported(engine.optimizer)
    assert not set(BOUNDARY_METHODS) & set(vars(engine.optimizer))


def test_an_unknown_boundary_is_refused(build):
    engine = build("fp32", 1, "deepspeed")
    with pytest.raises(ValueError, match="one of foreach, deepspeed"):
        optimizer_boundary.install(engine.optimizer, "fused")
