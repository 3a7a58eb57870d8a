"""Reading a tupe-export folder (either format) back into tupe_ds: `load_exported(DIR)`.

Needs neither DeepSpeed nor transformers: tupe-finetune and tupe-compare's figures read exports
with it.
"""

import dataclasses
import json
import os

from safetensors.torch import load_file

from tupe_ds.export.hf.convert import from_transformers
from tupe_ds.model.bert import build_model
from tupe_ds.model.config import ModelConfig
from tupe_ds.tools.errors import ExportError


def read_export_description(directory: str) -> dict:
    """config.json of a tupe-export folder; ExportError naming the fix for anything else."""
    if not os.path.isdir(directory):
        raise ExportError(f"{directory}: no such folder; give a folder written by tupe-export")
    if not os.path.exists(os.path.join(directory, "config.json")):
        if os.path.exists(os.path.join(directory, "run.json")) or os.path.isdir(
                os.path.join(directory, "checkpoints")):
            raise ExportError(f"{directory} is a tupe-pretrain run, not an exported model: run "
                              f"tupe-export {directory} --out EXPORT_DIR, then give EXPORT_DIR")
        raise ExportError(f"{directory}: not a tupe-export folder (no config.json); tupe-export "
                          "RUN_DIR --out DIR writes one from a pretraining run")
    with open(os.path.join(directory, "config.json")) as f:
        description = json.load(f)
    if "model_type" not in description:
        if not {"kind", "model"} <= set(description):
            raise ExportError(f"{directory}/config.json: not written by tupe-export (no kind and "
                              "model); give a folder written by tupe-export")
        return {**description, "format": "tupe"}
    if description["model_type"] != "tupe" or "tupe_ds" not in description:
        raise ExportError(f"{directory}/config.json: a transformers {description['model_type']!r} "
                          "model, not one tupe-export wrote; give a folder written by tupe-export")
    return {**description["tupe_ds"], "format": "hf"}


def exported_config(directory: str) -> tuple:
    """(ModelConfig, description) of a tupe-export folder tupe_ds can load; ExportError naming
    the fix otherwise."""
    description = read_export_description(directory)
    if description["kind"] == "electra-generator":
        raise ExportError(f"{directory}: an ELECTRA generator, exported for transformers; "
                          "tupe_ds fine-tunes the discriminator: export without --electra-network")
    try:
        return ModelConfig.from_record(description["model"]), description
    except (TypeError, ValueError) as error:
        raise ExportError(f"{directory}/config.json: {error} (written by another tupe_ds "
                          "version: export the checkpoint again with this one)") from None


def load_exported(directory: str):
    """(model, config, kind) from a tupe-export folder of either format: a BertForMaskedLM on
    this process's device, its masked-LM head absent (left at its initial values) for ELECTRA
    discriminators. Eager, whatever the run compiled: batches padded to their longest text vary
    in shape, and each shape would compile again."""
    config, description = exported_config(directory)
    config = dataclasses.replace(config, compile="none")
    model = build_model(config)
    device = str(next(model.parameters()).device)
    state = load_file(os.path.join(directory, "model.safetensors"), device=device)
    if description["format"] == "hf":
        state = {name: tensor for name, tensor in
                 from_transformers(state, config.num_attention_heads).items()
                 if not name.startswith("discriminator_head.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = ("lm_head.",) if description["kind"] == "electra-discriminator" else ()
    missing = [n for n in missing if not n.endswith("_extra_state") and not n.startswith(allowed)]
    if missing or unexpected:
        raise ExportError(f"{directory}: does not fit {config.pos_encoding} {config.num_layers} "
                          f"layers: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model, config, description["kind"]
