"""--bf16 (tupe_ds/train/precision.py): the --ds-config trained in bf16, refused where a GPU
lacks it; and the line that says, on GPUs that all have bf16, that an fp16 run is one flag away
from it (doctor.Machine, the project's description of a machine, describes the GPUs)."""

import json
import os

import pytest

from tupe_ds.machine.doctor import Machine
from tupe_ds.tools.errors import Refused
from tupe_ds.train import precision
from tupe_ds.train.config import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP16_CONFIG = os.path.join(ROOT, "ds_configs", "bert_base_fp16.json")
H100S = Machine("cuda", 8, ((9, 0),) * 8)
V100S = Machine("cuda", 2, ((7, 0),) * 2)
CPU = Machine("cpu", 0)


def run_config(data, tmp_path, machine, *flags):
    return load(["--data", data, "--model", "tiny", "--seq-len", "64", "--steps", "10",
                 "--ds-config", FP16_CONFIG, "--micro-batch", "8", "--out", str(tmp_path / "run"),
                 *flags], world_size=1, machine=machine)


def test_bf16_trains_the_config_in_bf16(data, tmp_path):
    with open(FP16_CONFIG) as f:
        shipped = json.load(f)
    for machine in (H100S, CPU):  # DeepSpeed's CPU accelerator trains bf16 too
        run = run_config(data, tmp_path, machine, "--bf16")
        assert run.ds_config["bf16"] == {"enabled": True} and "fp16" not in run.ds_config
        assert {model.dtype for model in run.models} == {"bf16"}
        assert run.ds_config["zero_optimization"] == shipped["zero_optimization"]
        assert run.ds_config["optimizer"] == shipped["optimizer"]
    assert "fp16" in run_config(data, tmp_path, H100S).ds_config  # fp16 stays the default


def test_bf16_is_refused_where_a_gpu_lacks_it(data, tmp_path):
    with pytest.raises(Refused) as refused:
        run_config(data, tmp_path, Machine("cuda", 2, ((8, 0), (7, 0))), "--bf16")
    assert str(refused.value) == (
        "--bf16: bf16 needs GPUs of compute capability 8.0 or newer "
        "(A100, H100, H200); these have 7.0, 8.0: leave --bf16 out (the --ds-config's precision "
        "runs here)")
    assert not os.path.exists(tmp_path / "run")


def test_an_fp16_run_on_gpus_with_bf16_says_it_is_one_flag_away():
    line = precision.bf16_advice([H100S, H100S], "fp16")  # two nodes of H100s
    assert line.startswith("tupe-pretrain: every GPU of this run has bf16: --bf16 trains this "
                           "config in bf16, with no loss scaling, so no step is skipped for an "
                           "fp16 overflow")
    assert "the overflow check before each step stays, as in fp16" in line
    assert line.endswith("Speed on these GPUs: not measured")
    assert precision.bf16_advice([H100S, V100S], "fp16") is None  # one node without
    assert precision.bf16_advice([H100S], "bf16") is None
    assert precision.bf16_advice([H100S], "fp32") is None  # fp32 is a choice, not an oversight
    assert precision.bf16_advice([CPU], "fp16") is None
