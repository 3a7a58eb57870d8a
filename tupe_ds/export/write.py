"""tupe-export: a pretraining checkpoint as one fp32 model that transformers and tupe_ds load.

    tupe-export runs/large/checkpoints --out exported/large           # its newest checkpoint
    tupe-export runs/large/checkpoints/step100000 --out exported/large-100k
    tupe-export runs/electra --out exported/electra-gen --electra-network generator

RUN_DIR/run.json (written by tupe-pretrain) says which model and layout the checkpoint holds.
The checkpoint's files are checked first (the manifest's sizes and checksums, no file it does
not list, every pickle read with weights_only: tupe_ds/train/checkpoint/safe_load.py), and
DeepSpeed's zero_to_fp32, which asks for weights_only=False, reads them with weights_only all
the same (safe_load.weights_only_loads).
Each model-parallel slice (tensor-parallel rank x pipeline stage) becomes an fp32 state dict:
through DeepSpeed's zero_to_fp32 where ZeRO optimizer shards hold the fp32 weights (any ZeRO
stage, fp16/bf16 runs included), else from the saved module. Pipeline parameter names are mapped
back to BertForMaskedLM's, and tensor-parallel shards are joined along the dimension they were
split on. DIR is written in one of FORMATS. ELECTRA runs export the discriminator (the network to
fine-tune) or, for transformers, the generator.

`load_exported(DIR)` builds the model from a folder of either format (tp=1; DeepSpeed need not be
installed).
"""

from tupe_ds.tools import startup  # first: the collector paused while libraries import
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor

from tupe_ds.distributed.parallel import end_distributed, ensure_model_parallel
from tupe_ds.export.hf.convert import write_folder
from tupe_ds.export.read import ExportError
from tupe_ds.model.bert import BertForMaskedLM
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.electra import ElectraForPretraining
from tupe_ds.model.pipeline_names import bert_name
from tupe_ds.tools import command_line
from tupe_ds.tools.files import file_digest, replacing_folder
from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import manifest, reads, safe_load
from tupe_ds.train.checkpoint.folder import latest_step, survey, tag_of
from tupe_ds.train.checkpoint.reshard import saved_layout

FORMATS = {
    "hf": "a transformers model (AutoModel* with trust_remote_code=True, AutoTokenizer): "
          "config.json, configuration_tupe.py, modeling_tupe.py, model.safetensors, tokenizer "
          "files (tupe_ds/export/hf/)",
    "tupe": "tupe_ds's own, as earlier versions wrote it: model.safetensors with tupe_ds's "
            "names, config.json (the ModelConfig), tokenizer.json",
}


def find_checkpoint(path: str) -> tuple:
    """(run folder, checkpoint folder) from RUN_DIR, RUN_DIR/checkpoints (its newest complete
    checkpoint of the run's own lineage, as run.json names it) or RUN_DIR/checkpoints/stepN."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if not os.path.basename(path).startswith("step"):
        own = run_description.lineage(os.path.dirname(path))
        complete = survey(path)[0]
        ours = [step for step, record in complete.items() if own in (None, record["lineage"])]
        newest = max(ours) if ours else latest_step(path)
        if newest:
            path = os.path.join(path, tag_of(newest))
    if not files_named(path, "*mp_rank_*_model_states.pt"):
        raise ExportError(f"{path}: not a complete DeepSpeed checkpoint (no mp_rank_*_model_states.pt);"
                          " give RUN_DIR/checkpoints (its newest) or RUN_DIR/checkpoints/stepN")
    return os.path.dirname(os.path.dirname(path)), path


def files_named(folder: str, pattern: str) -> List[str]:
    """The paths of the files in `folder` whose names match the glob `pattern`, in name order;
    the listing retried (reads.list_folder; reads.Unreadable after the window): glob answers
    nothing for a folder it could not list, and a slice whose ZeRO shards went unseen would be
    exported from the module's fp16 weights."""
    return [os.path.join(folder, name)
            for name in sorted(fnmatch.filter(reads.list_folder(folder), pattern))]


def check_files(step_dir: str) -> None:
    """Before DeepSpeed's zero_to_fp32 unpickles anything: the manifest's sizes and checksums,
    and every .pt read with weights_only (a checkpoint of an earlier version, without a
    manifest, only the latter)."""
    if manifest.exists(step_dir):
        try:
            files = manifest.read(step_dir)["files"]
        except ValueError as error:
            raise ExportError(str(error)) from None
        problems = manifest.check_files(step_dir, files) + manifest.unlisted(step_dir, files)
    else:
        files = files_named(step_dir, "*.pt")
        problems = [problem for problem in map(safe_load.scan, files) if problem]
    if problems:
        raise ExportError("; ".join(problems))


def slice_state(step_dir: str, rank: int, tp: int) -> Dict[str, Tensor]:
    """The fp32 parameters of model-parallel rank `rank` (stage * tp + tensor rank), named as in
    the engine's module."""
    mark = f"mp_rank_{rank:02d}"
    if files_named(step_dir, f"*{mark}_optim_states.pt"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 reads one model-parallel rank: show it this one's files as rank 00.
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "slice"))
            for path in files_named(step_dir, f"*{mark}_*states.pt"):
                target = os.path.join(tmp, "slice", os.path.basename(path).replace(mark, "mp_rank_00"))
                states = safe_load.load(path)
                if "module" in states and states["module"] is None:  # pipeline: layers saved apart
                    torch.save({**states, "module": {}}, target)
                else:
                    os.symlink(path, target)
            state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="slice")
        return {name: tensor.float() for name, tensor in state.items()}
    states = safe_load.load(os.path.join(step_dir, f"{mark}_model_states.pt"))
    if states["module"] is None:  # a pipeline stage without ZeRO: its layer files
        return pipeline_layer_files(step_dir, rank % tp, states)
    return {name: t.float() for name, t in states["module"].items() if torch.is_tensor(t)}


def pipeline_layer_files(step_dir: str, tensor_rank: int, states: dict) -> Dict[str, Tensor]:
    """A pipeline stage's parameters from the layer_NN-model_TT files, named as the engine's
    module names them (its model states list those names)."""
    names = {name for group in states["param_shapes"] for name in group}
    state = {}
    for path in files_named(step_dir, f"layer_*-model_{tensor_rank:02d}-model_states.pt"):
        index = int(re.match(r"layer_(\d+)", os.path.basename(path)).group(1))
        for key, tensor in safe_load.load(path).items():
            for name in (f"{index}.{key}", f"tied_modules.word_embeddings.{key}",
                         f"tied_modules.positional.{key}"):
                if name in names and torch.is_tensor(tensor):
                    state[name] = tensor.float()
    return state


def model_names(state: Dict[str, Tensor], layer_indices: list) -> Dict[str, Tensor]:
    """BertForMaskedLM names for a pipeline stage's parameters; `layer_indices` lists the pipeline
    indices of the transformer layers of the whole model, in order."""
    renamed = {bert_name(name, layer_indices, copies=False): tensor
               for name, tensor in state.items()}
    renamed.pop(None, None)  # the last stage's copy of the tied word embedding
    return renamed


def join_tensor_parallel(shards: list, reference: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """One state dict from the tensor-parallel ranks' ones: each parameter is concatenated along
    the one dimension where its shard is 1/tp of the tp=1 model's, or taken from rank 0."""
    tp = len(shards)
    joined = {}
    for name, full in reference.items():
        if name not in shards[0]:
            raise ExportError(f"the checkpoint has no parameter {name}")
        shard = shards[0][name]
        split = [d for d in range(full.dim()) if shard.shape[d] * tp == full.shape[d] != shard.shape[d]]
        joined[name] = torch.cat([s[name] for s in shards], dim=split[0]) if split else shard
        if joined[name].shape != full.shape:
            raise ExportError(f"{name}: {tuple(shard.shape)} per tensor-parallel rank does not make "
                              f"{tuple(full.shape)}")
    return joined


def reference_state(configs: list) -> Dict[str, Tensor]:
    """The parameters of the run's model at tp=1: names and shapes to join the shards to."""
    ensure_model_parallel(1)
    model = ElectraForPretraining(*configs) if len(configs) == 2 else BertForMaskedLM(configs[0])
    return {n: t for n, t in model.state_dict().items() if torch.is_tensor(t)}


def network_state(state: Dict[str, Tensor], network: Optional[str]) -> Dict[str, Tensor]:
    """An ELECTRA network's parameters named as a BertForMaskedLM's (its head kept), with the
    shared embedding; `state` itself for a masked-LM run (network None)."""
    if network is None:
        return state
    renames = {"embedding.": "embedding.", f"{network}.": "encoder.",
               f"{network}_head.": "lm_head." if network == "generator" else f"{network}_head.",
               **({"generator_projection.": "generator_projection."}
                  if network == "generator" else {})}
    return {renames[prefix] + name[len(prefix):]: tensor for name, tensor in state.items()
            for prefix in renames if name.startswith(prefix)}


def consolidated_state(run: dict, step_dir: str) -> tuple:
    """(the run's ModelConfigs at tp=1 in fp32, its fp32 parameters named as in
    BertForMaskedLM or ElectraForPretraining) from a checkpoint of any layout; `run` is the
    run's run.json."""
    tp, pp = run["tp"], run["pp"]
    try:
        configs = [dataclasses.replace(ModelConfig.from_record(model), tensor_parallel_size=1,
                                       dtype="fp32")
                   for model in run["models"]]
    except (TypeError, ValueError) as error:
        raise ExportError(f"{os.path.dirname(os.path.dirname(step_dir))}/run.json: its models "
                          f"are not model configs of this tupe_ds ({error})") from None
    slices = [slice_state(step_dir, rank, tp) for rank in range(tp * pp)]
    if pp > 1:
        layer_indices = sorted({int(name.split(".")[0]) for state in slices for name in state
                                if name.split(".")[0].isdigit()})
        by_tp = [{} for _ in range(tp)]
        for rank, state in enumerate(slices):  # rank = stage * tp + tensor rank
            by_tp[rank % tp].update(model_names(state, layer_indices))
        slices = by_tp
    return configs, join_tensor_parallel(slices, reference_state(configs))


def export(checkpoint: str, out: str, format: str = "hf", network: str = "discriminator",
           tokenizer: Optional[str] = None) -> str:
    """`out` in FORMATS[format] from a checkpoint; ELECTRA runs export `network`. The tokenizer
    is `tokenizer`, else the run's (run.json's data folder), checked against the vocabulary the
    checkpoint's manifest records."""
    run_dir, step_dir = find_checkpoint(checkpoint)
    try:
        run = run_description.read(run_dir)
    except ValueError as error:
        raise ExportError(str(error)) from None
    electra = run["objective"] == "electra"
    if network != "discriminator" and not (electra and format == "hf"):
        raise ExportError(f"--electra-network {network}: only an ELECTRA run's generator, in "
                          "--format hf, can be exported; leave the flag out")
    tokenizer = tokenizer or os.path.join(run["data"], "tokenizer.json")
    check_tokenizer(tokenizer, step_dir)
    masking = None  # a checkpoint of an earlier version records none
    if manifest.exists(step_dir):  # run.json says the layout of the run's last start
        try:
            record = manifest.read(step_dir)
            layout = saved_layout(record)
        except ValueError as error:
            raise ExportError(str(error)) from None
        run = {**run, "tp": layout.tp, "pp": layout.pp}
        masking = record["identity"].get("masking")
    with safe_load.weights_only_loads():  # zero_to_fp32's loads included
        check_files(step_dir)
        configs, state = consolidated_state(run, step_dir)
    state = network_state(state, network if electra else None)
    if format == "tupe":  # a BertForMaskedLM's parameters only, as earlier versions read
        state = {n: t for n, t in state.items() if not n.startswith("discriminator_head.")}
    config = configs[1] if network == "generator" else configs[0]
    save_exported(out, state, config, f"electra-{network}" if electra else "bert-mlm",
                  tokenizer, source=step_dir, format=format,
                  embedding_size=configs[0].hidden_size, masking=masking)
    return step_dir


def check_tokenizer(path: str, step_dir: str) -> None:
    """ExportError unless `path` is a tokenizer file and, where the checkpoint's manifest records
    the vocabulary it was trained with, that one."""
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no tokenizer there (run.json's data folder); give the one the "
                          "run was trained with: --tokenizer PATH")
    if not manifest.exists(step_dir):
        return  # a checkpoint of an earlier version records none
    try:
        recorded = manifest.read(step_dir)["identity"].get("vocabulary")
    except ValueError as error:
        raise ExportError(str(error)) from None
    if recorded is not None and file_digest(path) != recorded:
        raise ExportError(f"{path} is not the tokenizer {step_dir} was trained with (its "
                          "manifest records another vocabulary); give that one: --tokenizer PATH")


def save_exported(out: str, state: Dict[str, Tensor], config: ModelConfig, kind: str,
                  tokenizer: str, source: str, format: str = "hf",
                  embedding_size: Optional[int] = None, masking: Optional[dict] = None) -> None:
    """`out` in FORMATS[format] from a state dict named as tupe_ds's models name it; the folder
    appears when complete. `masking`: the pretraining's (a MaskingScheme as a dict), for the
    model card."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
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


def main(argv=None) -> int:
    startup.resume_collector()
    p = argparse.ArgumentParser(prog="tupe-export", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    command_line.add_config_flags(p)
    add_verbose_flag(p)
    p.add_argument("checkpoint", help="RUN_DIR, RUN_DIR/checkpoints (its newest) or .../stepN")
    p.add_argument("--out", required=True, help="folder to write (replaced when complete)")
    p.add_argument("--format", choices=FORMATS, default="hf",
                   help="; ".join(f"{name}: {text}" for name, text in FORMATS.items()))
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the tokenizer.json the run was trained with (default: the one in "
                        "run.json's data folder); checked against the checkpoint's manifest")
    p.add_argument("--electra-network", choices=["discriminator", "generator"],
                   default="discriminator", help="the ELECTRA network to export (generator: hf)")
    args = command_line.parse(p, argv)
    try:
        step_dir = export(args.checkpoint, args.out, args.format, args.electra_network,
                          args.tokenizer)
    except ExportError as error:
        print(f"tupe-export: error: {error}", file=sys.stderr)
        return 2
    except reads.Unreadable as error:  # the filesystem, not the checkpoint: nothing was written
        print(f"tupe-export: {error}", file=sys.stderr)
        return 3
    print(f"exported {step_dir} -> {args.out} ({', '.join(sorted(os.listdir(args.out)))})")
    end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
