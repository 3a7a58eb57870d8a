"""The formats tupe-export writes a model in (FORMATS), and `save_exported`, which writes one.

A folder is written from a state dict named as tupe_ds's models name it, and appears only when
complete; read.py reads either format back.
"""

import dataclasses
import json
import os
import shutil
from typing import Dict, Optional

from safetensors.torch import save_file
from torch import Tensor

from tupe_ds.export.hf.convert import CODE_FILES, write_folder
from tupe_ds.model.config import ModelConfig
from tupe_ds.tools.errors import ExportError
from tupe_ds.tools.files import replacing_folder

FORMATS = {
    "hf": "a transformers model (AutoModel* with trust_remote_code=True, AutoTokenizer): "
          "config.json, configuration_tupe.py, modeling_tupe.py, model.safetensors, tokenizer "
          "files (tupe_ds/export/hf/)",
    "tupe": "tupe_ds's own, as earlier versions wrote it: model.safetensors with tupe_ds's "
            "names, config.json (the ModelConfig), tokenizer.json",
}


# what an hf export writes (the tupe format: model.safetensors, config.json and its tokenizer)
HF_FILES = {"model.safetensors", "config.json", "README.md", *CODE_FILES, "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"}


def check_out(out: str) -> str:
    """The folder an export of --out `out` writes: its real path (a symbolic link's target).
    ExportError unless it is missing, an empty folder or an earlier export (which the export
    replaces), outside the working directory, with no .tmp beside it but a killed export's:
    nothing else is ever deleted."""
    real = os.path.realpath(out)
    if os.path.commonpath([real, os.path.realpath(os.getcwd())]) == real:
        raise ExportError(f"--out {out} is the working directory or a folder above it: give a "
                          "folder outside it")
    for path, complete in ((real, True), (real + ".tmp", False)):
        if theirs := not_exported(path, complete):
            raise ExportError(
                f"--out {out}: {path} holds {', '.join(theirs[:5])}"
                f"{' ...' if len(theirs) > 5 else ''}, which no export of tupe-export wrote: "
                "nothing was changed. Give a new folder (or an earlier export, which is "
                "replaced) as --out" + ("" if complete else f", or move {path} aside"))
    return real


def not_exported(folder: str, complete: bool) -> list:
    """What `folder` holds that an export does not write ([]: nothing, or no folder there); not
    `complete` (a killed export's .tmp), any part of an export."""
    if not os.path.lexists(folder):
        return []
    if not os.path.isdir(folder):
        return ["(it is a file)"]
    names = sorted(os.listdir(folder))
    others = [name for name in names
              if name not in HF_FILES or os.path.isdir(os.path.join(folder, name))]
    if len(others) == 1 and "tokenizer.json" not in names and tupe_format(folder) and \
            tokenizer_file(os.path.join(folder, others[0])):
        others = []  # the tupe format's tokenizer, copied under its own name after config.json
    if complete and names and not others and not {"model.safetensors", "config.json"} <= set(
            names):
        return names
    return others


def tokenizer_file(path: str) -> bool:
    """Whether `path` is a tokenizers JSON file (as tupe-prep writes one)."""
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and {"model", "added_tokens"} <= content.keys()


def tupe_format(folder: str) -> bool:
    """Whether `folder`'s config.json is the tupe format's."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"kind", "model"} <= config.keys()


def save_exported(out: str, state: Dict[str, Tensor], config: ModelConfig, kind: str,
                  tokenizer: str, source: str, format: str = "hf",
                  embedding_size: Optional[int] = None, masking: Optional[dict] = None) -> None:
    """`out` in FORMATS[format] from a state dict named as tupe_ds's models name it; the folder
    appears when complete. `masking`: the pretraining's (a MaskingScheme as a dict), for the
    model card."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    out = check_out(out)
    with replacing_folder(out) as folder:
        if format == "hf":
            write_folder(folder, state, config, kind, tokenizer, source,
                         embedding_size or config.hidden_size, masking)
            return
        save_file({n: t.contiguous() for n, t in state.items()},
                  os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"kind": kind, "model": dataclasses.asdict(config), "source": source}, f,
                      indent=1)
        shutil.copy(tokenizer, folder)
