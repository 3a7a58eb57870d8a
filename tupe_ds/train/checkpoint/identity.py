"""What makes a run the run it is: the stream it reads and the model it trains.

A checkpoint's manifest records it; resuming with any of it changed would continue the saved
step and data position in another stream or another model, so it is refused before any process
starts, naming each difference. How the work is split (tp, pp, dp, micro-batch, ZeRO stage,
the attention kernels' layout) is not part of it: reshard.py carries a run across layouts.
"""

import dataclasses
import os
from typing import List, Sequence

from tupe_ds.data.blend import Source, whole_shares
from tupe_ds.data.packing import dataset_digest
from tupe_ds.tools.files import file_digest

# ModelConfig fields that choose how the same model is computed or split, not what it is
HOW_COMPUTED = ("tensor_parallel_size", "attention", "key_padding", "untied_as_columns",
                "head_multiple", "fused_elementwise")


# What a checkpoint written before a setting existed was made with
BEFORE_RECORDED = {"loss_normalization": "micro-batch"}


def run_identity(objective: str, model: str, models: tuple, sources: Sequence[Source],
                 seq_len: int, global_batch: int, masking, seed: int,
                 loss_normalization: str) -> dict:
    """The identity of a run: data (the sentence lengths and document boundaries of each split,
    which define the packed samples; their digests kept in each source's index cache; for a
    blend, each source's with its samples per period of the blend's schedule), vocabulary
    (tokenizer.json), the sample stream's settings, the models and the objective, with its loss
    normalisation."""
    def digests(source):
        return {split: dataset_digest(os.path.join(source.folder, split), source.index_cache)
                for split in ("train", "valid")}

    if len(sources) == 1:
        data = digests(sources[0])
    else:
        per_period = whole_shares([source.weight for source in sources])
        data = {"blend": [{"per_period": int(count), **digests(source)}
                          for source, count in zip(sources, per_period)]}
    return {
        "objective": objective, "model": model, "seed": seed, "seq_len": seq_len,
        "loss_normalization": loss_normalization,
        "global_batch": global_batch, "masking": dataclasses.asdict(masking),
        "vocabulary": file_digest(os.path.join(sources[0].folder, "tokenizer.json")),
        "data": data,
        "models": [{k: v for k, v in dataclasses.asdict(config).items() if k not in HOW_COMPUTED}
                   for config in models],
    }


def flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in flatten(item, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value)
                for k, v in flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


DESCRIPTIONS = {"data": "the data (--data)", "vocabulary": "the vocabulary (tokenizer.json)"}
FLAGS = {"objective": "--objective", "model": "--model", "seed": "--seed", "seq_len": "--seq-len",
         "global_batch": "--global-batch", "loss_normalization": "--loss-normalization"}


def differences(saved: dict, current: dict) -> List[str]:
    """One line per setting that differs: 'seq_len: 128 in the checkpoint, 512 now'. A setting
    the checkpoint does not record has the value of BEFORE_RECORDED."""
    now = flatten(current)
    before = {**{k: v for k, v in BEFORE_RECORDED.items() if k in now}, **flatten(saved)}
    lines = []
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            top = key.split(".")[0].split("[")[0]
            if top in DESCRIPTIONS:
                line = f"{DESCRIPTIONS[top]}: other content than the checkpoint's ({key})"
            else:
                line = f"{key}: {before.get(key)!r} in the checkpoint, {now.get(key)!r} now"
                if key in FLAGS:
                    line += f" ({FLAGS[key]})"
            if line not in lines:
                lines.append(line)
    return lines
