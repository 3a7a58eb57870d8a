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


def check_out(out: str) -> None:
    """ExportError unless `out` is missing, an empty folder or a model folder an export wrote,
    which the export replaces (files only: model.safetensors, config.json, and else only what an
    export writes: README.md, the model's code, .json); nothing else is ever deleted."""
    try:
        names = sorted(os.listdir(out))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise ExportError(f"--out {out} is a file, not a folder: give a folder (a new one, or "
                          "an earlier export, which is replaced)") from None
    written = {"model.safetensors", "config.json", "README.md", *CODE_FILES}
    theirs = [name for name in names if os.path.isdir(os.path.join(out, name))
              or name not in written and not name.endswith(".json")]
    if names and (theirs or not {"model.safetensors", "config.json"} <= set(names)):
        shown = theirs or names
        raise ExportError(
            f"--out {out} holds {', '.join(shown[:5])}{' ...' if len(shown) > 5 else ''}, "
            "which is no model folder tupe-export wrote: nothing was changed. Give a new folder "
            "(or an earlier export, which is replaced) as --out")


def save_exported(out: str, state: Dict[str, Tensor], config: ModelConfig, kind: str,
                  tokenizer: str, source: str, format: str = "hf",
                  embedding_size: Optional[int] = None, masking: Optional[dict] = None) -> None:
    """`out` in FORMATS[format] from a state dict named as tupe_ds's models name it; the folder
    appears when complete. `masking`: the pretraining's (a MaskingScheme as a dict), for the
    model card."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    check_out(out)
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
