"""docs/code-map.md, made from the tree: each package in the order data flows through them, with
one line per module, its docstring's first sentence. tests/test_code_map.py checks the page is
what this makes; after adding, moving or renaming a module (or changing its docstring's first
sentence) write it again:

    .venv/bin/python tests/support/code_map.py > docs/code-map.md
"""

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The packages in the order data flows through them: a new package is placed here, or this fails.
PACKAGES = {
    "data_prep": "raw text to indexed datasets (`tupe-prep`)",
    "tupe_ds/data": "indexed datasets to the batches of a step",
    "tupe_ds/model": "the transformer and its positional encodings",
    "tupe_ds/distributed": "processes, launchers and parallel groups",
    "tupe_ds/train": "a run: configuration, steps, schedule, monitoring (`tupe-pretrain`)",
    "tupe_ds/train/run_folder": "a run folder apart from its checkpoints: lock, run.json, settings",
    "tupe_ds/train/checkpoint": "a run's checkpoints: saved, verified, chosen, resumed",
    "tupe_ds/export": "checkpoints to a model folder (`tupe-export`)",
    "tupe_ds/export/hf": "the Hugging Face format",
    "tupe_ds/finetune": "GLUE fine-tuning of an exported model (`tupe-finetune`)",
    "tupe_ds/compare": "encodings compared: runs, fine-tunes, report (`tupe-compare`)",
    "tupe_ds/machine": "what a machine can run (`tupe-doctor`, `tupe-smoke`)",
    "tupe_ds/tools": "what every command shares: files, locks, settings, start-up",
    "tupe_ds/demo": "`make demo`",
}
HEADER = """# Code map

Where each part of tupe_ds lives, in the order data flows through it:

```text
raw text -> data_prep (tupe-prep) -> DIR/{train,valid}.{bin,idx}, tokenizer.json
  -> tupe_ds/data (samples, masks, batches) -> tupe_ds/model (the network)
  -> tupe_ds/train with tupe_ds/distributed (tupe-pretrain under a launcher)
  -> OUT/run.lock, OUT/run.json (tupe_ds/train/run_folder), OUT/tensorboard, OUT/train_log.jsonl
  -> OUT/checkpoints (tupe_ds/train/checkpoint)
  -> tupe_ds/export (tupe-export) -> tupe_ds/finetune (tupe-finetune)
  -> tupe_ds/compare (tupe-compare: all of it, per encoding, and the report)
```

Beside them: `bench/` (speed, memory and chaos measurements), `slurm/` (batch scripts),
`ds_configs/` and `configs/` (DeepSpeed and tupe-pretrain settings), `tests/`
([Development](development.md)). This page is made from the modules' docstrings by
`tests/support/code_map.py`, and `tests/test_code_map.py` fails when it no longer matches the
tree.
"""


def first_sentence(path: str) -> str:
    with open(path) as f:
        docstring = ast.get_docstring(ast.parse(f.read())) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


def packages() -> list:
    """Every folder of tupe_ds/ and data_prep/ holding an __init__.py, relative to ROOT."""
    found = []
    for top in ("data_prep", "tupe_ds"):
        for folder, names, files in os.walk(os.path.join(ROOT, top)):
            names[:] = sorted(n for n in names if n != "__pycache__")
            if "__init__.py" in files:
                found.append(os.path.relpath(folder, ROOT))
    return found


def page() -> str:
    found = set(packages()) - {"tupe_ds"}
    unplaced = sorted(found - set(PACKAGES))
    if unplaced:
        raise SystemExit(f"tests/support/code_map.py: place {', '.join(unplaced)} in PACKAGES")
    lines = [HEADER]
    lines.append("## `tupe_ds/` itself\n")
    lines += module_lines("tupe_ds")
    for package, role in PACKAGES.items():
        if package in found:
            lines.append(f"## `{package}/`: {role}\n")
            lines += module_lines(package)
    return "\n".join(lines)


def module_lines(package: str) -> list:
    folder = os.path.join(ROOT, package)
    modules = sorted(name for name in os.listdir(folder) if name.endswith(".py"))
    lines = [f"- `{package}/{name}`: {first_sentence(os.path.join(folder, name))}"
             for name in modules if name != "__main__.py"]
    return lines + [""]


if __name__ == "__main__":
    sys.stdout.write(page())
