"""Presets and the validation of ModelConfig."""

import pytest
import torch

import tupe_ds
from tupe_ds import ModelConfig


@pytest.mark.parametrize("preset, shape", [
    ("bert-base", (12, 768, 12, 3072)),
    ("bert-large", (24, 1024, 16, 4096)),
    ("electra-base-discriminator", (12, 768, 12, 3072)),
    ("electra-base-generator", (12, 256, 4, 1024)),
])
def test_presets(preset, shape):
    config = ModelConfig.from_preset(preset)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.ffn_hidden_size) == shape
    assert (config.vocab_size, config.max_position_embeddings) == (32768, 512)


@pytest.mark.parametrize("overrides, field, words", [
    (dict(num_attention_heads=16, tensor_parallel_size=3), "num_attention_heads", "tensor_parallel_size=3"),
    (dict(hidden_size=100), "hidden_size", "not divisible by num_attention_heads"),
    (dict(seq_length=1024), "seq_length", "beyond max_position_embeddings=512"),
    (dict(pos_encoding="alibi"), "pos_encoding", "unknown encoding 'alibi'"),
    (dict(pos_encoding="mask-nope", causal_layers=13), "causal_layers", "between 1 and num_layers=12"),
    (dict(causal_layers=2), "causal_layers", "only applies to pos_encoding='mask-nope'"),
    (dict(num_layers=0), "num_layers", "positive integer"),
    (dict(attention_dropout=1.5), "attention_dropout", "[0, 1)"),
    (dict(dtype="fp8"), "dtype", "unknown dtype 'fp8'"),
])
def test_invalid_settings_name_the_field(overrides, field, words):
    with pytest.raises(ValueError) as error:
        ModelConfig.from_preset("bert-base", **overrides)
    assert f"ModelConfig.{field}:" in str(error.value)
    assert words in str(error.value)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown preset 'bert-huge'"):
        ModelConfig.from_preset("bert-huge")
    with pytest.raises(ValueError, match="unknown ModelConfig field.*num_heads"):
        tupe_ds.build_model("tiny", num_heads=2)


def test_mask_nope_defaults_to_one_causal_layer():
    assert ModelConfig.from_preset("tiny", pos_encoding="mask-nope").causal_layers == 1


def test_build_model_in_a_plain_process():
    model = tupe_ds.build_model("tiny", pos_encoding="rope", num_layers=1)
    assert model.model_config.num_layers == 1
    logits = model(torch.randint(0, 512, (2, 8)))
    assert logits.shape == (2, 8, 512)
    config = ModelConfig.from_preset("tiny")
    assert tupe_ds.build_model(config, pos_encoding="nope").model_config.pos_encoding == "nope"


def test_tensor_parallel_without_processes_is_explained():
    with pytest.raises(RuntimeError, match="tensor_parallel_size=1, but the model asks for 2"):
        tupe_ds.build_model("tiny", tensor_parallel_size=2)
