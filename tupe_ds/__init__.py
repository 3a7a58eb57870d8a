"""tupe_ds: pretraining BERT and ELECTRA with the TUPE positional encoding on DeepSpeed + megatron-core."""

from tupe_ds.model import ENCODINGS, PRESETS, BertForMaskedLM, ModelConfig, build_model

__all__ = ["BertForMaskedLM", "ENCODINGS", "ModelConfig", "PRESETS", "build_model"]
__version__ = "0.1.0"
