"""What a start of tupe-pretrain records of the run: OUT/run.json's description (models, layout,
data, lineage, the checkpoint resumed), and what each of its checkpoints carries (its layout, and
the record in its manifest)."""

import dataclasses
import os

from tupe_ds.train import recorded_settings, run_description
from tupe_ds.train.checkpoint import history, reshard, safe_load
from tupe_ds.train.config import RunConfig
from tupe_ds.train.monitor import run_flops_per_step


def write_run_description(run: RunConfig, lineage: str) -> None:
    """OUT/run.json: the models, layout, lineage and settings of the run, for other tools
    (run_description.py); decisions are the history's (checkpoint/history.py)."""
    batch = run.ds_config["train_batch_size"]
    description = {"objective": run.objective, "lineage": lineage,
                   "data": os.path.abspath(run.data),
                   "sources": [{"folder": os.path.abspath(source.folder), "weight": source.weight,
                                "name": source.name} for source in run.sources],
                   "tp": run.layout.tp, "pp": run.layout.pp, "steps": run.steps,
                   "global_batch": batch, "seq_len": run.seq_len,
                   "masking": dataclasses.asdict(run.masking),
                   "rampup_batch_size": str(run.batch_split.ramp) if run.batch_split.ramp
                   else None,
                   "lr_schedule": run.ds_config.get("scheduler"),
                   "branched_from": run.branch_origin or run_description.branched_from(run.out),
                   "flops_per_step": run_flops_per_step(run.models, batch, run.seq_len),
                   "micro_batch": {"size": run.batch_split.micro_batch,  # auto_micro_batch.py
                                   "auto": run.batch_split.auto},  # reads it at the next start
                   "models": [dataclasses.asdict(config) for config in run.models],
                   recorded_settings.FIELD: run.settings}
    run_description.write(run.out, description)


def saved_layout(run: RunConfig, engine) -> reshard.SavedLayout:
    """This run's layout, as its checkpoints record it."""
    return reshard.SavedLayout(
        world_size=run.world_size, tp=run.layout.tp, pp=run.layout.pp, dp=run.layout.dp,
        zero_stage=engine.zero_optimization_stage(),
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation=engine.gradient_accumulation_steps(),
        vocab_size=run.models[0].vocab_size)


def describe_run(run: RunConfig, lineage: str, say) -> None:
    """Rank 0: OUT/run.json written (write_run_description), saying so where the one there was
    damaged."""
    damage = run_description.damage(run.out)
    if damage:
        say(f"tupe-pretrain: {damage}: written anew", flush=True)
    write_run_description(run, lineage)


def checkpoint_record(run: RunConfig, lineage: str, plan=None) -> dict:
    """What the manifest of each checkpoint this start saves records of it (save.py)."""
    return {"lineage": lineage, "identity": run.identity,  # for the manifests
            "training": run.training, "resumed_from": plan.tag if plan else None,
            "consents": history.consents(history.read(run.out) or []),  # a lost history's
            "init_from": run.init_plan.step_dir if run.init_plan else None,
            "software": safe_load.software_versions(),  # what a resume can load: safe_load
            "lr_schedule": run.ds_config.get("scheduler")}  # its steps ran under: a --branch
