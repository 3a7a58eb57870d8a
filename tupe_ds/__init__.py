"""tupe_ds: pretraining BERT and ELECTRA with the TUPE positional encoding on DeepSpeed + megatron-core."""

from tupe_ds.model import (ENCODINGS, PRESETS, BertForMaskedLM, ElectraForPretraining, ModelConfig,
                           build_electra, build_model)

__all__ = ["BertForMaskedLM", "ENCODINGS", "ElectraForPretraining", "ModelConfig", "PRESETS",
           "build_electra", "build_model"]
__version__ = "0.1.0"
