"""tupe_ds: pretraining BERT and ELECTRA with the TUPE positional encoding on DeepSpeed + megatron-core."""

import importlib

from tupe_ds.tools.first_call_compile import defer_library_compiles

__all__ = ["BertForMaskedLM", "ENCODINGS", "ElectraForPretraining", "ModelConfig", "PRESETS",
           "build_electra", "build_model"]
__version__ = "0.1.0"

defer_library_compiles()


def __getattr__(name: str):
    """The model API from tupe_ds.model, imported on first use, so that light modules
    (tupe_ds.tools.files, which data_prep uses) do not load torch and megatron-core."""
    if name in __all__:
        return getattr(importlib.import_module("tupe_ds.model"), name)
    raise AttributeError(f"module 'tupe_ds' has no attribute {name!r}")
