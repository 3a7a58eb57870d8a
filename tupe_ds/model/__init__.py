"""The model: config -> positional module -> attention -> encoder -> heads."""

from tupe_ds.model.bert import BertForMaskedLM, build_model
from tupe_ds.model.config import ENCODINGS, PRESETS, ModelConfig
from tupe_ds.model.electra import ElectraForPretraining, build_electra

__all__ = ["BertForMaskedLM", "ENCODINGS", "ElectraForPretraining", "ModelConfig", "PRESETS",
           "build_electra", "build_model"]
