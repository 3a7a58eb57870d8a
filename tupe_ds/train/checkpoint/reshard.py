"""Resuming a checkpoint on a different layout: other data-parallel or tensor-parallel sizes.

ZeRO's optimizer shards belong to the data-parallel size that wrote them, and each tensor rank's
files to its tensor-parallel size. A run resumed on another layout (a requeued job that got a
different number of nodes) converts the checkpoint once with DeepSpeed's universal checkpoint
(`ds_to_universal`) and loads it with `"checkpoint": {"load_universal": true}`: weights, Adam's
moments and step, the loss scaler, the schedule and the data position carry over. What the
conversion needs to join tensor-parallel slices is saved with every checkpoint
(`universal_info`, from megatron-core's attributes of each parameter). Each rank's random state
belongs to the old layout too: on a new one every rank derives its generators from (seed, step,
rank). A change of micro-batch and gradient accumulation alone (same ranks) needs none of this.

Every decision is taken from the layout the manifest records (also in `stepN/layout.json`) before
any process starts, so a layout that cannot be reshaped is refused with what to do.
"""

import json
import os
import re
import shutil
import time
from argparse import Namespace
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch

from tupe_ds.tools.files import write_atomically
from tupe_ds.tools.third_party_warnings import quietly
from tupe_ds.train.checkpoint import manifest, reads, safe_load

LAYOUT_FILE = "layout.json"
UNIVERSAL_FOLDER = "universal"  # CHECKPOINTS/universal/stepN: converted checkpoints
CONVERTED_FROM = "converted_from"  # in a conversion: the source checkpoint's manifest digest


@dataclass(frozen=True)
class SavedLayout:
    """The layout that wrote a checkpoint (its layout.json)."""
    world_size: int
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int
    gradient_accumulation: int
    vocab_size: int  # the model's, padded for this tp

    def __str__(self) -> str:
        return (f"{self.world_size} processes (tp {self.tp}, pp {self.pp}, dp {self.dp}, "
                f"micro-batch {self.micro_batch} x {self.gradient_accumulation} accumulation)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_record(cls, record) -> "SavedLayout":
        """From a manifest's "layout" (or layout.json); ValueError saying what is wrong."""
        names = [field.name for field in fields(cls)]
        if not isinstance(record, dict) or sorted(record) != sorted(names):
            raise ValueError(f"a layout has the fields {', '.join(names)}")
        if any(type(record[name]) is not int or record[name] < 0 for name in names):
            raise ValueError("a layout's fields are counts")
        return cls(**record)


@dataclass(frozen=True)
class Reshard:
    """How a run on another layout resumes `tag`."""
    tag: str
    saved: SavedLayout
    convert: bool  # through DeepSpeed's universal checkpoint (ZeRO); else it loads as it is


def layout_file(step_dir: str) -> Optional[SavedLayout]:
    """stepN/layout.json, for a checkpoint of an earlier version without a manifest; None
    without one; ValueError naming the file when it is not a layout (or no regular file inside
    the checkpoint); reads.Unreadable when the filesystem does not give it for the retry
    window."""
    path = os.path.join(step_dir, LAYOUT_FILE)
    try:
        record = json.loads(reads.read_bytes(path, root=step_dir).decode("utf-8"))
        return SavedLayout.from_record(record)
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as error:  # NotRegularFile is a ValueError
        raise ValueError(f"{path}: not a layout tupe-pretrain wrote ({error}); restore the file, "
                         "or resume from another checkpoint with --resume-from") from None


def saved_layout(record: dict) -> SavedLayout:
    """The layout that wrote a checkpoint, from its manifest's record; ValueError naming the
    checkpoint when it is not one."""
    try:
        return SavedLayout.from_record(record["layout"])
    except ValueError as error:
        raise ValueError(f"checkpoint {record['tag']}: its manifest's layout is damaged "
                         f"({error})") from None


def plan(tag: str, saved: SavedLayout, world_size: int, tp: int, pp: int, zero_stage: int,
         has_zero_shards: bool) -> Optional[Reshard]:
    """None when the checkpoint resumes as it is; a Reshard when it resumes on this new layout;
    ValueError saying what to do when it cannot."""
    dp = world_size // (tp * pp)
    written = f"checkpoint {tag} was written by {saved} with ZeRO stage {saved.zero_stage}"
    if (saved.zero_stage == 0) != (zero_stage == 0):
        held = "partitioned by ZeRO" if saved.zero_stage else "whole (no ZeRO)"
        raise ValueError(f"{written}: its optimizer state is {held}, which ZeRO stage "
                         f"{zero_stage} does not load (DeepSpeed would start Adam's moments "
                         f"anew); resume with --zero-stage {saved.zero_stage}")
    same = (f"resume on {saved.world_size} processes with --tp {saved.tp} --pp {saved.pp} "
            "(the layout that wrote it)")
    if (saved.zero_stage == 3) != (zero_stage == 3):
        raise ValueError(f"{written}: ZeRO stage 3 partitions the weights themselves, and its "
                         f"checkpoints load only into stage 3 and stage 3 only loads its own: "
                         f"resume with --zero-stage {saved.zero_stage}")
    if (saved.tp, saved.pp, saved.dp) == (tp, pp, dp):
        return None
    if pp > 1 or saved.pp > 1:
        raise ValueError(f"{written}; pipeline-parallel checkpoints resume only on their own "
                         f"layout, and this run has {world_size} processes with --tp {tp} "
                         f"--pp {pp}: {same}")
    if 3 in (saved.zero_stage, zero_stage):
        raise ValueError(f"{written}; tupe-pretrain reshapes checkpoints of ZeRO stage 0-2 "
                         f"only: {same}")
    if saved.zero_stage == 0 and (tp != saved.tp or has_zero_shards):
        raise ValueError(f"{written}; without ZeRO only its data-parallel size can change, and "
                         f"only where the optimizer state is whole (not bf16's): {same}")
    if tp != saved.tp and saved.vocab_size % (128 * tp):
        raise ValueError(f"checkpoint {tag} has a vocabulary padded to {saved.vocab_size} for "
                         f"tp {saved.tp}, which does not split into --tp {tp} shards of a multiple "
                         f"of 128: {same}")
    return Reshard(tag=tag, saved=saved, convert=saved.zero_stage > 0)


def has_zero_shards(step_dir: str) -> bool:
    """Whether the checkpoint holds ZeRO's partitioned optimizer state (stage 1-2, or the bf16
    optimizer), which DeepSpeed ties to the data-parallel size. The listing is retried
    (reads.list_folder): one that failed would take a ZeRO checkpoint for a whole one."""
    return any(re.search(r"zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$", name)
               for name in reads.list_folder(step_dir))


def universal_info(model) -> dict:
    """What ds_to_universal needs to join each parameter's tensor-parallel slices, named by
    parameter: row-parallel ones (megatron-core's partition_dim 1) on dim 1, the replicated ones
    (LayerNorms, row-parallel biases, the positional p) from one slice; the rest (column-parallel
    weights and biases, the vocabulary embedding) on dim 0, the converter's default."""
    from deepspeed.checkpoint import constants

    row, replicated = [], []
    for name, parameter in model.named_parameters():
        pattern = re.escape(name) + "$"
        if not getattr(parameter, "tensor_model_parallel", False):
            replicated.append(pattern)
        elif getattr(parameter, "partition_dim", 0) == 1:
            row.append(pattern)
    return {constants.UNIVERSAL_CHECKPOINT_VERSION_KEY:
            constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            constants.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
            constants.TP_REPLICATED_PARAMETER_PATTERNS: replicated}


def universal_dir(checkpoints: str) -> str:
    return os.path.join(checkpoints, UNIVERSAL_FOLDER)


def convert(checkpoints: str, tag: str) -> float:
    """Rank 0: CHECKPOINTS/TAG -> CHECKPOINTS/universal/TAG through DeepSpeed's ds_to_universal,
    once: a conversion records the manifest digest of the checkpoint it came from and the size
    and checksum of each of its files (CONVERTED_FROM), and is reused only for that checkpoint
    and only while its files verify (else made anew); written in a temporary folder and renamed
    when complete. Returns the seconds it took (0 when reused)."""
    from deepspeed.checkpoint import ds_to_universal

    source_digest = manifest_digest(os.path.join(checkpoints, tag))
    target = os.path.join(universal_dir(checkpoints), tag)
    if reusable(target, source_digest):
        return 0.0
    work = os.path.join(universal_dir(checkpoints), f".tmp-{tag}")
    shutil.rmtree(work, ignore_errors=True)
    start = time.monotonic()
    args = Namespace(input_folder=conversion_source(os.path.join(checkpoints, tag), work),
                     output_folder=os.path.join(work, tag), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True,
                     inject_missing_state=False)
    try:
        quietly(lambda: ds_to_universal.main(args))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    files = manifest.describe(args.output_folder, conversion_files(args.output_folder))
    write_atomically(os.path.join(args.output_folder, CONVERTED_FROM),
                     json.dumps({"source": source_digest, "files": files}))
    shutil.rmtree(target, ignore_errors=True)  # a conversion of another checkpoint of this name
    os.rename(args.output_folder, target)
    shutil.rmtree(work)
    return time.monotonic() - start


def manifest_digest(step_dir: str) -> str:
    """The digest of the checkpoint's manifest ("" for a checkpoint of an earlier version)."""
    return manifest.digest(step_dir) if manifest.exists(step_dir) else ""


def conversion_files(folder: str) -> list:
    """The files of a conversion, by their paths inside it."""
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names
                  if name != CONVERTED_FROM)


def reusable(target: str, source_digest: str) -> bool:
    """Whether the conversion in `target` came from the checkpoint of `source_digest` and holds
    exactly the files it recorded, each of its size and checksum and read weights-only."""
    try:
        with open(os.path.join(target, CONVERTED_FROM), "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
        files = record["files"]
        if record["source"] != source_digest or sorted(files) != conversion_files(target):
            return False
        return not manifest.check_files(target, files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return False  # none there, one of an earlier version, or a damaged record


def conversion_source(step_dir: str, work: str) -> str:
    """ds_to_universal's input: the checkpoint's DeepSpeed files, linked, except the model files,
    copied without their None entries: megatron-core's parallel layers save an `_extra_state` of
    None, which ds_to_universal (0.19) takes for a weight to convert."""
    source = os.path.join(work, "source")
    os.makedirs(source)
    for name in os.listdir(step_dir):
        path = os.path.join(step_dir, name)
        if re.match(r"^mp_rank_\d+_model_states\.pt$", name):
            state = safe_load.load(path)
            state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, os.path.join(source, name))
        elif name.endswith("_optim_states.pt"):
            os.symlink(os.path.abspath(path), os.path.join(source, name))
    return source


def remove_conversions_before(checkpoints: str, step: int) -> None:
    """Rank 0, after a save: conversions of older checkpoints are not needed again."""
    folder = universal_dir(checkpoints)
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        match = re.match(r"^(?:\.tmp-)?step(\d+)$", name)
        if match and int(match.group(1)) < step:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
