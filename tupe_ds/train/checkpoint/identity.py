"""What makes a run the run it is: the stream it reads and the model it trains.

A checkpoint's manifest records it; resuming with any of it changed would continue the saved
step and data position in another stream or another model, so it is refused before any process
starts, naming each difference. How the work is split (tp, pp, dp, micro-batch, ZeRO stage,
the attention kernels' layout) is not part of it: reshard.py carries a run across layouts.
"""

import dataclasses
import os
import re
from typing import List, Sequence

from tupe_ds.data.blend_schedule import SCHEDULE, whole_shares
from tupe_ds.data.packing import dataset_digest
from tupe_ds.data.sources import Source
from tupe_ds.tools.files import file_digest

# ModelConfig fields that choose how the same model is computed or split, not what it is
HOW_COMPUTED = ("tensor_parallel_size", "attention", "key_padding", "untied_as_columns",
                "head_multiple", "compile")


# What a checkpoint written before a setting existed was made with
BEFORE_RECORDED = {"loss_normalization": "micro-batch", "rampup_batch_size": None}


def run_identity(objective: str, model: str, models: tuple, sources: Sequence[Source],
                 seq_len: int, global_batch: int, masking, seed: int,
                 loss_normalization: str, rampup_batch_size=None) -> dict:
    """The identity of a run: data (the sentence lengths and document boundaries of each split,
    which define the packed samples; their digests kept in each source's index cache; for a
    blend, each source's with its samples per period of the blend's schedule), vocabulary
    (tokenizer.json), the sample stream's settings, the models and the objective, with its loss
    normalisation. A batch ramp (START, INCREMENT, SAMPLES) is part of it: it decides which
    samples each step reads."""
    def digests(source):
        return {split: dataset_digest(os.path.join(source.folder, split), source.index_cache)
                for split in ("train", "valid")}

    if len(sources) == 1:
        data = digests(sources[0])
    else:
        per_period = whole_shares([source.weight for source in sources])
        data = {"schedule": SCHEDULE,
                "blend": [{"per_period": int(count), **digests(source)}
                          for source, count in zip(sources, per_period)]}
    return {
        "objective": objective, "model": model, "seed": seed, "seq_len": seq_len,
        "loss_normalization": loss_normalization,
        "global_batch": global_batch, "masking": dataclasses.asdict(masking),
        "rampup_batch_size": str(rampup_batch_size) if rampup_batch_size else None,
        "vocabulary": file_digest(os.path.join(sources[0].folder, "tokenizer.json")),
        "data": data,
        "models": [{k: v for k, v in dataclasses.asdict(config).items() if k not in HOW_COMPUTED}
                   for config in models],
    }


def flatten(value) -> dict:
    """{"models[0].hidden_dropout": 0.1, ...}: every leaf of nested dicts and lists by its path
    (iterative: a damaged record nested a thousand deep is read too)."""
    leaves, stack = {}, [("", value)]
    while stack:
        prefix, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{prefix}.{key}" if prefix else str(key), child)
                         for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{prefix}[{i}]", child) for i, child in enumerate(item))
        else:
            leaves[prefix] = item
    return leaves


def training_settings(ds_config: dict) -> dict:
    """What the optimizer and the schedule are given (a checkpoint's manifest records it): the
    optimizer's type and parameters, the scheduler's (its end, total_num_steps, follows
    --steps: a larger --steps trains on) and gradient clipping."""
    scheduler = ds_config.get("scheduler", {})
    return {"optimizer": ds_config.get("optimizer"),
            "scheduler": {"type": scheduler.get("type"),
                          "params": {k: v for k, v in scheduler.get("params", {}).items()
                                     if k != "total_num_steps"}},
            "gradient_clipping": ds_config.get("gradient_clipping")}


# What a resumed run may change with --allow-training-changes (a decay branch, --branch, always):
# what tupe-pretrain sets again after DeepSpeed restored the checkpoint's parameter groups
# (optim.apply_config), and what the engine and the scheduler read from the config (a schedule is
# a function of the step alone: its type too). The rest (the optimizer's type, amsgrad, its
# implementation) made the optimizer state the checkpoint holds.
CHANGEABLE_AT_RESUME = re.compile(r"^(optimizer\.params\.(lr|betas\[\d\]|eps|weight_decay)"
                                  r"|scheduler\..*|gradient_clipping)$")


DESCRIPTIONS = {"data": "the data (--data)", "vocabulary": "the vocabulary (tokenizer.json)"}
FLAGS = {"objective": "--objective", "model": "--model", "seed": "--seed", "seq_len": "--seq-len",
         "global_batch": "--global-batch", "loss_normalization": "--loss-normalization",
         "masking.probability": "--mask-rate", "masking.mask": "--mask-split",
         "masking.random": "--mask-split",
         "optimizer.params.lr": "--lr", "scheduler.params.warmup_max_lr": "--lr",
         "scheduler.params.warmup_num_steps": "--warmup-steps", "scheduler.type": "--lr-schedule",
         "scheduler.params.decay_num_steps": "--decay-steps",
         "scheduler.params.decay_shape": "--decay-shape",
         "rampup_batch_size": "--rampup-batch-size"}


def differences(saved: dict, current: dict, which=lambda key: True) -> List[str]:
    """One line per setting that differs (of those whose flattened key `which` accepts):
    'seq_len: 128 in the checkpoint, 512 now'. A setting the checkpoint does not record has the
    value of BEFORE_RECORDED."""
    now = flatten(current)
    before = {**{k: v for k, v in BEFORE_RECORDED.items() if k in now}, **flatten(saved)}
    lines = []
    for key in sorted(set(before) | set(now)):
        if not which(key):
            continue
        if before.get(key) != now.get(key) and not both_nan(before.get(key), now.get(key)):
            top = key.split(".")[0].split("[")[0]
            if key == "data.schedule" and key in now and any(
                    name.startswith("data.blend") for name in before):
                written = before.get(key, "samples per 10,000 (before 2026-11-26)")
                line = (f"the blend's schedule: {written} in the checkpoint, {now[key]} now: "
                        "resume with the tupe_ds that wrote the checkpoint, or start a new run "
                        "from it with --init-from")
            elif top in DESCRIPTIONS:
                line = f"{DESCRIPTIONS[top]}: other content than the checkpoint's ({key})"
            else:
                line = f"{key}: {before.get(key)!r} in the checkpoint, {now.get(key)!r} now"
                if key in FLAGS:
                    line += f" ({FLAGS[key]})"
            if line not in lines:
                lines.append(line)
    return lines


def both_nan(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b
