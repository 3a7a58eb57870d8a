"""The shipped DeepSpeed configs hold the paper's setting (appendix B, Table 2)."""

import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CONFIGS = ["bert_large_fp16_zero2.json", "bert_base_fp16_zero2.json", "bert_large_zero3_offload.json",
               "electra_base_fp16_zero2.json"]


def read(name):
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        return json.load(f)


def test_every_config_is_listed_here():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))}
    assert names == set(GPU_CONFIGS) | {"cpu_zero2.json"}


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
    assert stage == (3 if "zero3" in name else 2)
    if stage == 3:
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_cpu_config_has_no_fp16():
    config = read("cpu_zero2.json")
    assert not config.get("fp16", {}).get("enabled")
    assert config["zero_optimization"]["stage"] == 2
    assert config["optimizer"]["params"]["torch_adam"]  # no extension to compile on a CPU
