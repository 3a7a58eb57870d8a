"""OUT/run.json: what a run is (models, layout, data, lineage), written by rank 0 at each start
for tupe-export, tupe-compare and micro_batch.py; what a start decides from is the history's."""

import dataclasses
import json
import logging
import os

from tupe_ds.tools.files import write_atomically
from tupe_ds.train import monitor  # a module: it imports this one (through checkpoint)
from tupe_ds.train.checkpoint import reads

logger = logging.getLogger(__name__)

FILE = "run.json"
FIELDS = {"objective": str, "data": str, "tp": int, "pp": int, "models": list}  # what readers use


def read(out: str) -> dict:
    """OUT/run.json as a dict; ValueError naming the file when it is missing or not one;
    reads.Unreadable when the filesystem does not give it for the retry window."""
    path = os.path.join(out, FILE)
    try:
        description = json.loads(reads.read_bytes(path, root=out).decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; tupe-pretrain writes it when a run starts") from None
    except (ValueError, RecursionError) as error:  # NotRegularFile, UnicodeDecodeError too
        raise ValueError(f"{path}: not readable as a run description ({error})") from None
    if not isinstance(description, dict):
        raise ValueError(f"{path}: not a run description (not a JSON object)")
    for field, kind in FIELDS.items():
        value = description.get(field)
        if not isinstance(value, kind) or isinstance(value, bool) or (
                kind is list and not all(isinstance(item, dict) for item in value)):
            raise ValueError(f"{path}: not a run description tupe-pretrain wrote ({field} is "
                             f"missing or not a {kind.__name__})")
    if not isinstance(description.get("lineage", "-"), str) or description.get("lineage") == "":
        raise ValueError(f"{path}: not a run description tupe-pretrain wrote (lineage not a name)")
    return description


def recorded(out: str) -> dict:
    """OUT/run.json as it is ({} when it does not read)."""
    try:
        return read(out)
    except ValueError:
        return {}


def lineage(out: str) -> str | None:
    """The lineage OUT/run.json records; None when there is none to read."""
    return recorded(out).get("lineage")


def describe_run(run, lineage: str) -> None:
    """Rank 0: OUT/run.json, atomically: the models, layout, data, lineage and schedule of `run`
    (a branch's origin kept from the one there, said where that was damaged)."""
    path = os.path.join(run.out, FILE)
    try:
        earlier = read(run.out)
    except ValueError as error:
        earlier = {}
        if os.path.exists(path):
            logger.info(f"tupe-pretrain: {error}: written anew")
    batch = run.ds_config["train_batch_size"]
    write_atomically(path, json.dumps({
        "objective": run.objective, "lineage": lineage, "data": os.path.abspath(run.data),
        "sources": [{"folder": os.path.abspath(source.folder), "weight": source.weight,
                     "name": source.name} for source in run.sources],
        "tp": run.layout.tp, "pp": run.layout.pp, "steps": run.steps, "global_batch": batch,
        "seq_len": run.seq_len, "masking": dataclasses.asdict(run.masking),
        "rampup_batch_size": str(run.batch_split.ramp) if run.batch_split.ramp else None,
        "lr_schedule": run.ds_config.get("scheduler"),
        "branched_from": run.branch_origin or earlier.get("branched_from"),
        "flops_per_step": monitor.run_flops_per_step(run.models, batch, run.seq_len),
        "micro_batch": {"size": run.batch_split.micro_batch, "auto": run.batch_split.auto},
        "models": [dataclasses.asdict(config) for config in run.models]}, indent=1))
