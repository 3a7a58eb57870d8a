"""The model: config -> positional module -> attention -> encoder -> heads."""

from tupe_ds.model.bert import BertForMaskedLM, build_model
from tupe_ds.model.config import ENCODINGS, PRESETS, ModelConfig

__all__ = ["BertForMaskedLM", "ENCODINGS", "ModelConfig", "PRESETS", "build_model"]
