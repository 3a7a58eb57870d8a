"""What makes a run the run it is, and what a start may change of the checkpoint it goes on from."""

import dataclasses
import os
import re
from typing import Optional

from tupe_ds.data import blend_schedule, packing
from tupe_ds.tools.files import file_digest
from tupe_ds.train.checkpoint import manifest
from tupe_ds.train.schedule import ran_under, resume_rate_change

HOW_COMPUTED = ("tensor_parallel_size", "attention", "key_padding", "untied_as_columns",
                "head_multiple", "compile")  # ModelConfig fields: how it is computed or split
CHANGEABLE_AT_INIT = ("seq_length", "hidden_dropout", "attention_dropout", "dtype")  # --init-from
# What a resume may change (optim.apply_config sets it again; the rest made the optimizer state)
CHANGEABLE_AT_RESUME = re.compile(r"^(optimizer\.params\.(lr|betas\[\d\]|eps|weight_decay)"
                                  r"|scheduler\..*|gradient_clipping)$")
NEW_RUN = "start a new run from its weights: --out NEW --init-from "  # + the checkpoint
DESCRIPTIONS = {"data": "the data (--data)", "vocabulary": "the vocabulary (tokenizer.json)"}
FLAGS = {**{key: "--" + key.replace("_", "-") for key in ("objective", "model", "seed",
            "seq_len", "global_batch", "loss_normalization", "rampup_batch_size")},
         "masking.probability": "--mask-rate", "masking.mask": "--mask-split",
         "masking.random": "--mask-split", "optimizer.params.lr": "--lr",
         "scheduler.params.warmup_max_lr": "--lr", "scheduler.type": "--lr-schedule",
         "scheduler.params.decay_shape": "--decay-shape",
         **{f"scheduler.params.{k}_num_steps": f"--{k}-steps" for k in ("warmup", "decay")}}


def run_identity(objective, model, models, sources, seq_len, global_batch, masking, seed,
                 loss_normalization, rampup_batch_size=None) -> dict:
    """The run's data (digests; a blend's per source), vocabulary, stream settings and models."""
    def digests(source):
        return {split: packing.dataset_digest(os.path.join(source.folder, split),
                                              source.index_cache) for split in ("train", "valid")}
    data = digests(sources[0]) if len(sources) == 1 else {
        "schedule": blend_schedule.SCHEDULE, "blend": [
            {"per_period": int(n), **digests(source)} for source, n
            in zip(sources, blend_schedule.whole_shares([s.weight for s in sources]))]}
    return {"objective": objective, "model": model, "seed": seed, "seq_len": seq_len,
            "loss_normalization": loss_normalization, "global_batch": global_batch,
            "masking": dataclasses.asdict(masking),
            "rampup_batch_size": str(rampup_batch_size) if rampup_batch_size else None,
            "vocabulary": file_digest(os.path.join(sources[0].folder, "tokenizer.json")),
            "data": data, "models": [{k: v for k, v in dataclasses.asdict(config).items()
                                      if k not in HOW_COMPUTED} for config in models]}


def training_settings(ds_config: dict) -> dict:
    """The optimizer, gradient clipping and scheduler (less total_num_steps: --steps moves it)."""
    scheduler = ds_config.get("scheduler", {})
    params = {k: v for k, v in scheduler.get("params", {}).items() if k != "total_num_steps"}
    return {"optimizer": ds_config.get("optimizer"), "gradient_clipping": ds_config.get(
        "gradient_clipping"), "scheduler": {"type": scheduler.get("type"), "params": params}}


def differences(saved, current, which=lambda key: True) -> list:
    """Lines 'seq_len: 128 in the checkpoint, 512 now (--seq-len)', never an exception."""
    leaves, stack = ({}, {}), [(0, "", saved), (1, "", current)]
    while stack:  # not recursive: a damaged record may nest a thousand deep
        side, prefix, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((side, f"{prefix}.{key}" if prefix else str(key), child)
                         for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((side, f"{prefix}[{i}]", child) for i, child in enumerate(item))
        else:
            leaves[side][prefix] = item
    lines = []
    for key in sorted(set(leaves[0]) | set(leaves[1])):
        old, new = leaves[0].get(key), leaves[1].get(key)
        if which(key) and old != new and not (old != old and new != new):  # both nan
            top = key.split(".")[0].split("[")[0]
            lines.append(f"{DESCRIPTIONS[top]}: other content than the checkpoint's ({key})"
                         if top in DESCRIPTIONS else f"{key}: {old!r} in the checkpoint, "
                         f"{new!r} now" + (f" ({FLAGS[key]})" if key in FLAGS else ""))
    return lines


def refuse_another_run(plan, current: dict, training: dict, allow_training_changes: bool) -> None:
    """ValueError naming each difference from the resumed checkpoint's identity and training."""
    step_dir = os.path.join(plan.directory, plan.tag)
    saved = manifest.read(step_dir)
    if lines := differences(saved["identity"], current):
        anew = ("else start a new run in another --out" if init_differences(saved, current) else
                f"to change them deliberately, {NEW_RUN}{step_dir}")
        raise ValueError(f"{step_dir} is another run than this command's: {'; '.join(lines)}. "
                         f"Resume it with its own settings; {anew}")
    training_changes(step_dir, training, allow_training_changes)


def training_changes(step_dir: str, training: dict, allow: bool, doing="resuming") -> list:
    """Lines naming the changes `allow` lets through; else, or if not changeable, ValueError."""
    saved = manifest.read(step_dir).get("training")
    if saved is None:
        raise ValueError(f"{step_dir} records no training settings: a checkpoint of a tupe_ds "
                         f"before 2026-11-29. Resume it with that version, or {NEW_RUN}{step_dir}")
    fixed = differences(saved, training, lambda key: not CHANGEABLE_AT_RESUME.match(key))
    changes = differences(saved, training, CHANGEABLE_AT_RESUME.match)
    if fixed:
        raise ValueError(f"{step_dir} was trained with other settings, which its optimizer state "
                         f"was made with and a resumed run cannot change: {'; '.join(fixed)}. "
                         f"Resume with the checkpoint's settings, or {NEW_RUN}{step_dir}")
    if changes and not allow:
        raise ValueError(f"{step_dir} was trained with other optimizer or schedule settings: "
                         f"{'; '.join(changes)}. Resume with the checkpoint's settings, or add "
                         "--allow-training-changes to go on with these (the run says what changed)")
    why = " (--allow-training-changes)" if doing == "resuming" else ""
    return [f"tupe-pretrain: {doing} {os.path.basename(step_dir)} with changed training "
            f"settings{why}: {change}" for change in changes]


def moved_rate(step_dir: str, steps: int, scheduler: Optional[dict], allow: bool) -> list:
    """A resume of `step_dir` whose --steps moves the rate of the step after it (a decay's end,
    a warmup cut to --steps): ValueError naming both rates; with `allow`, the line saying it."""
    record = manifest.read(step_dir)
    tag, schedule = os.path.basename(step_dir), record.get("lr_schedule")
    change = resume_rate_change(schedule, record["step"], scheduler) if record["step"] < steps \
        else ""
    if change and not allow:
        raise ValueError(f"resuming {tag} with --steps {steps}: {change}. Resume with "
                         f"{ran_under(schedule)} to keep that schedule, or add "
                         "--allow-training-changes to go on with this one")
    return [f"tupe-pretrain: resuming {tag} with --steps {steps} (--allow-training-changes): "
            f"{change}"] if change else []


def init_differences(saved: dict, current: dict) -> list:
    """Lines naming how the vocabulary or parameters differ: what --init-from cannot change."""
    models = saved["identity"].get("models")
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ValueError(f"checkpoint {saved['tag']}: its manifest records no model configs")

    def fixed(identity: dict) -> dict:
        return {"vocabulary": identity.get("vocabulary"), "models": [{
            k: v for k, v in m.items() if k not in CHANGEABLE_AT_INIT} for m in identity["models"]]}
    return differences(fixed(saved["identity"]), fixed(current))
