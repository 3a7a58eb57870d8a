"""TORCH_CUDA_ARCH_LIST rewritten into what DeepSpeed's extension builder parses."""

import pytest

from tupe_ds.machine.cuda_arch import VARIABLE, deepspeed_arch_list, fit_cuda_arch_list

REWRITTEN = {"9.0a": "9.0", "8.0;9.0a": "8.0;9.0", "10.0f": "10.0", "9.0a+PTX": "9.0+PTX",
             "8.0 9.0a 10.0a": "8.0 9.0 10.0"}
KEPT = ["9.0", "9.0+PTX", "8.0;8.6;9.0+PTX", "7.0 7.5 8.0"]


@pytest.mark.parametrize("value", REWRITTEN)
def test_suffixes_are_dropped(value):
    assert deepspeed_arch_list(value) == REWRITTEN[value]


@pytest.mark.parametrize("value", KEPT)
def test_what_deepspeed_parses_is_kept(value):
    environ = {VARIABLE: value}
    assert fit_cuda_arch_list(environ) is None
    assert environ == {VARIABLE: value}


def test_the_environment_is_rewritten_with_a_note():
    environ = {VARIABLE: "8.0;9.0a", "OTHER": "1"}
    note = fit_cuda_arch_list(environ)
    assert environ == {VARIABLE: "8.0;9.0", "OTHER": "1"}
    assert "'8.0;9.0a' set to '8.0;9.0'" in note and "DeepSpeed" in note


def test_no_variable_no_change():
    environ = {}
    assert fit_cuda_arch_list(environ) is None
    assert environ == {}


@pytest.mark.parametrize("jit_mode", [True, False], ids=["jit", "prebuilt"])
@pytest.mark.parametrize("value", REWRITTEN)
def test_deepspeed_parses_the_rewritten_value_only(value, jit_mode, monkeypatch):
    """FusedAdam's own nvcc arguments, computed on the CPU (no CUDA needed once the variable is
    set): the original value fails there, the rewritten one passes."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = jit_mode
    monkeypatch.setenv(VARIABLE, value)
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.nvcc_args()
    fit_cuda_arch_list()
    builder.nvcc_args()
