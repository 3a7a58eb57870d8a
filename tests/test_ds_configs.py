"""The shipped DeepSpeed configs hold the paper's setting (appendix B, Table 2), and their
optimizer is built without compiling a DeepSpeed extension."""

import glob
import json
import os

import pytest
import torch

from tupe_ds.distributed.parallel import ensure_model_parallel, start_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CONFIGS = ["bert_large_fp16.json", "bert_base_fp16.json", "bert_large_zero3_offload.json",
               "electra_base_fp16.json"]
DEMO_CONFIGS = ["demo_bf16.json", "demo_fp16.json"]  # make demo on GPUs (tupe_ds/demo/run.py)


def read(name):
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        return json.load(f)


def test_every_config_is_listed_here():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))}
    assert names == set(GPU_CONFIGS) | set(DEMO_CONFIGS) | {"cpu_zero2.json"}


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_paper_setting(name):
    """TUPE appendix B for BERT; the ELECTRA paper's Base setting (peak lr 2e-4) for ELECTRA."""
    config = read(name)
    optimizer = config["optimizer"]["params"]
    peak = 2e-4 if name.startswith("electra") else 1e-4
    assert config["optimizer"]["type"] == "AdamW"
    assert (optimizer["lr"], optimizer["betas"], optimizer["eps"], optimizer["weight_decay"]) == (
        peak, [0.9, 0.999], 1e-6, 0.01)
    schedule = config["scheduler"]
    assert schedule["type"] == "WarmupDecayLR"  # linear warm-up, then linear decay to zero
    assert schedule["params"]["warmup_num_steps"] == 10000
    assert schedule["params"]["warmup_max_lr"] == peak and schedule["params"]["warmup_min_lr"] == 0
    assert config["gradient_clipping"] == 1.0
    assert config["train_batch_size"] == 256
    assert config["fp16"]["enabled"] and config["fp16"]["loss_scale"] == 0  # dynamic scaling
    stage = config["zero_optimization"]["stage"]
    assert stage == (3 if "zero3" in name else 1)  # gradients reduced once per optimizer step
    if stage == 3:
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_cpu_config_has_no_fp16():
    config = read("cpu_zero2.json")
    assert not config.get("fp16", {}).get("enabled")
    assert config["zero_optimization"]["stage"] == 2
    assert config["optimizer"]["params"]["torch_adam"]  # no extension to compile on a CPU


@pytest.fixture(scope="module")
def deepspeed():
    """DeepSpeed's communication over this process's one-rank gloo group (ensure_model_parallel's),
    started as tupe-pretrain starts it: without building DeepSpeed's shared-memory op."""
    import deepspeed

    ensure_model_parallel(1)
    start_distributed("gloo")
    return deepspeed


def build_without_compiling(name, deepspeed, monkeypatch):
    """The config's engine on the CPU in fp32 (DeepSpeed refuses fp16 without CUDA), with every
    DeepSpeed extension build made to fail."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(builder, *args, **kwargs):
        raise AssertionError(f"{name} makes DeepSpeed build its {builder.name} extension")

    monkeypatch.setattr(OpBuilder, "load", refuse)
    monkeypatch.setattr(OpBuilder, "jit_load", refuse)
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = read(name)
    config.pop("fp16", None)
    config.pop("bf16", None)
    config.update(train_batch_size=2, train_micro_batch_size_per_gpu=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine, config


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_optimizer_builds_without_compiling_anything(name, deepspeed, monkeypatch):
    """torch's fused AdamW ("torch_adam", "fused"), not DeepSpeed's FusedAdam or CPUAdam, whose JIT
    build needs a compiler (nvcc for FusedAdam, about 60 s) and fails on
    TORCH_CUDA_ARCH_LIST=9.0a."""
    engine, config = build_without_compiling(name, deepspeed, monkeypatch)
    optimizer = engine.basic_optimizer
    assert type(optimizer) is torch.optim.AdamW
    peak = 2e-4 if name.startswith("electra") else 1e-4
    settings = {key: optimizer.defaults[key]
                for key in ("lr", "betas", "eps", "weight_decay", "fused")}
    assert settings == {"lr": peak, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01,
                        "fused": True}
    if config["zero_optimization"]["stage"] == 1:  # no Python hook per parameter and micro-batch
        assert engine.optimizer._grad_acc_hooks == []
    engine.destroy()


@pytest.mark.parametrize("name", DEMO_CONFIGS)
def test_demo_configs_differ_only_in_precision_and_compile_nothing(name, deepspeed, monkeypatch):
    dtype = name[len("demo_"):-len(".json")]
    assert read(name)[dtype]["enabled"]
    others = [{k: v for k, v in read(n).items() if k not in ("fp16", "bf16")} for n in DEMO_CONFIGS]
    assert others[0] == others[1]
    engine, _ = build_without_compiling(name, deepspeed, monkeypatch)
    assert type(engine.basic_optimizer) is torch.optim.AdamW
    assert engine.optimizer._grad_acc_hooks == []
    engine.destroy()
