"""What a start may change from the checkpoint it goes on from, checked before any process
starts (from config.load).

A resume: nothing of the run's identity (`refuse_another_run`), and its optimizer and schedule
settings only with --allow-training-changes, never those its optimizer state was made with
(`training_changes`, also a --branch's); --init-from: anything but the vocabulary and the
parameters (`init_differences`)."""

import os
from typing import List

from tupe_ds.train.checkpoint import identity, manifest
from tupe_ds.train.checkpoint.resume import ResumePlan


def refuse_another_run(plan: ResumePlan, current: dict, training: dict,
                       allow_training_changes: bool) -> None:
    """ValueError naming every difference between the checkpoint's identity and this run's, and
    between their optimizer and schedule settings (training_changes)."""
    if not plan.verified or not plan.candidates:
        return  # an earlier version recorded none; or nothing to resume
    step_dir = os.path.join(plan.directory, plan.tag)
    saved = manifest.read(step_dir)
    differences = identity.differences(saved["identity"], current)
    if differences:
        start_anew = (f"to change them deliberately, start a new run from its weights: --out NEW "
                      f"--init-from {step_dir}" if not init_differences(saved, current) else
                      "else start a new run in another --out")
        raise ValueError(f"{step_dir} is another run than this command's: "
                         + "; ".join(differences) + f". Resume it with its own settings; "
                         f"{start_anew}")
    training_changes(step_dir, training, allow_training_changes)


def records_training(plan: "ResumePlan") -> bool:
    """Whether the checkpoint resumed records its training settings (this tupe_ds's do)."""
    return not plan.verified or "training" in manifest.read(
        os.path.join(plan.directory, plan.tag))


def training_changes(step_dir: str, training: dict, allow: bool,
                     doing: str = "resuming") -> List[str]:
    """The lines that say how this run's optimizer and schedule settings differ from the
    checkpoint's, when `allow` (--allow-training-changes) lets them; ValueError naming them
    otherwise, and always for the settings the checkpoint's optimizer state was made with
    (identity.CHANGEABLE_AT_RESUME)."""
    saved = manifest.read(step_dir)
    if "training" not in saved:
        return []  # written before the settings were recorded
    changeable = identity.CHANGEABLE_AT_RESUME.match
    fixed = identity.differences(saved["training"], training, lambda key: not changeable(key))
    if fixed:
        raise ValueError(
            f"{step_dir} was trained with other settings, which its optimizer state was made "
            "with and a resumed run cannot change: " + "; ".join(fixed) + ". Resume with the "
            f"checkpoint's settings, or start a new run from its weights: --out NEW --init-from "
            f"{step_dir}")
    changes = identity.differences(saved["training"], training, changeable)
    if changes and not allow:
        raise ValueError(
            f"{step_dir} was trained with other optimizer or schedule settings: "
            + "; ".join(changes) + ". Resume with the checkpoint's settings, or add "
            "--allow-training-changes to go on with these (the run then says what changed)")
    why = " (--allow-training-changes)" if doing == "resuming" else ""
    return [f"tupe-pretrain: {doing} {os.path.basename(step_dir)} with changed training "
            f"settings{why}: {change}" for change in changes]


def init_differences(saved: dict, current: dict) -> List[str]:
    """How a checkpoint's model differs from this run's in what --init-from cannot change (the
    vocabulary and the parameters; the sequence length, dropout and precision may change)."""
    changeable = {"seq_length", "hidden_dropout", "attention_dropout", "dtype"}
    return identity.differences(
        {"vocabulary": saved["identity"].get("vocabulary"), "models": [
            {k: v for k, v in m.items() if k not in changeable}
            for m in model_list(saved["identity"].get("models"), saved["tag"])]},
        {"vocabulary": current["vocabulary"], "models": [
            {k: v for k, v in m.items() if k not in changeable} for m in current["models"]]})


def model_list(models, tag: str) -> list:
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ValueError(f"checkpoint {tag}: its manifest records no model configs")
    return models
