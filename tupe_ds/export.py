"""tupe-export: a pretraining checkpoint as one fp32 model that loads without DeepSpeed.

    tupe-export runs/large/checkpoints --out exported/large           # its latest checkpoint
    tupe-export runs/large/checkpoints/step100000 --out exported/large-100k

RUN_DIR/run.json (written by tupe-pretrain) says which model and layout the checkpoint holds.
Each model-parallel slice (tensor-parallel rank x pipeline stage) becomes an fp32 state dict:
through DeepSpeed's zero_to_fp32 where ZeRO optimizer shards hold the fp32 weights (any ZeRO
stage, fp16/bf16 runs included), else from the saved module. Pipeline parameter names are mapped
back to BertForMaskedLM's, and tensor-parallel shards are joined along the dimension they were
split on. DIR gets model.safetensors, config.json (the ModelConfig at tp=1, fp32) and
tokenizer.json (from the run's data). ELECTRA runs export the discriminator (embedding and
encoder): the network to fine-tune.

`load_exported(DIR)` builds the model from such a folder (tp=1; DeepSpeed need not be installed).
"""

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Dict

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tupe_ds.files import replacing_folder
from tupe_ds.model.bert import BertForMaskedLM, build_model
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.pipeline_names import bert_name
from tupe_ds.parallel import end_distributed, ensure_model_parallel

KINDS = {"mlm": "bert-mlm", "electra": "electra-discriminator"}


class ExportError(Exception):
    pass


def find_checkpoint(path: str) -> tuple:
    """(run folder, checkpoint folder) from RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/stepN."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.exists(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    if not glob.glob(os.path.join(path, "*mp_rank_*_model_states.pt")):
        raise ExportError(f"{path}: not a complete DeepSpeed checkpoint (no mp_rank_*_model_states.pt);"
                          " give RUN_DIR/checkpoints (its latest) or RUN_DIR/checkpoints/stepN")
    run_dir = os.path.dirname(os.path.dirname(path))
    if not os.path.exists(os.path.join(run_dir, "run.json")):
        raise ExportError(f"{run_dir}/run.json: missing; tupe-pretrain writes it at the start of a run")
    return run_dir, path


def slice_state(step_dir: str, rank: int, tp: int) -> Dict[str, Tensor]:
    """The fp32 parameters of model-parallel rank `rank` (stage * tp + tensor rank), named as in
    the engine's module."""
    mark = f"mp_rank_{rank:02d}"
    if glob.glob(os.path.join(step_dir, f"*{mark}_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 reads one model-parallel rank: show it this one's files as rank 00.
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "slice"))
            for path in glob.glob(os.path.join(step_dir, f"*{mark}_*states.pt")):
                target = os.path.join(tmp, "slice", os.path.basename(path).replace(mark, "mp_rank_00"))
                states = torch.load(path, map_location="cpu", weights_only=False)
                if "module" in states and states["module"] is None:  # pipeline: layers saved apart
                    torch.save({**states, "module": {}}, target)
                else:
                    os.symlink(path, target)
            state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="slice")
        return {name: tensor.float() for name, tensor in state.items()}
    states = torch.load(os.path.join(step_dir, f"{mark}_model_states.pt"), map_location="cpu",
                        weights_only=False)
    if states["module"] is None:  # a pipeline stage without ZeRO: its layer files
        return pipeline_layer_files(step_dir, rank % tp, states)
    return {name: t.float() for name, t in states["module"].items() if torch.is_tensor(t)}


def pipeline_layer_files(step_dir: str, tensor_rank: int, states: dict) -> Dict[str, Tensor]:
    """A pipeline stage's parameters from the layer_NN-model_TT files, named as the engine's
    module names them (its model states list those names)."""
    names = {name for group in states["param_shapes"] for name in group}
    state = {}
    for path in glob.glob(os.path.join(step_dir, f"layer_*-model_{tensor_rank:02d}-model_states.pt")):
        index = int(re.match(r"layer_(\d+)", os.path.basename(path)).group(1))
        for key, tensor in torch.load(path, map_location="cpu", weights_only=False).items():
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


def reference_model(config: ModelConfig):
    ensure_model_parallel(1)
    return BertForMaskedLM(config)


def export(checkpoint: str, out: str) -> str:
    run_dir, step_dir = find_checkpoint(checkpoint)
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    tp, pp = run["tp"], run["pp"]
    config = dataclasses.replace(ModelConfig(**run["models"][0]), tensor_parallel_size=1,
                                 dtype="fp32")
    reference = {n: t for n, t in reference_model(config).state_dict().items() if torch.is_tensor(t)}
    slices = [slice_state(step_dir, rank, tp) for rank in range(tp * pp)]
    if pp > 1:
        layer_indices = sorted({int(name.split(".")[0]) for state in slices for name in state
                                if name.split(".")[0].isdigit()})
        by_tp = [{} for _ in range(tp)]
        for rank, state in enumerate(slices):  # rank = stage * tp + tensor rank
            by_tp[rank % tp].update(model_names(state, layer_indices))
        slices = by_tp
    if run["objective"] == "electra":  # the discriminator and the shared embedding
        slices = [{"encoder." + n[len("discriminator."):] if n.startswith("discriminator.") else n: t
                   for n, t in state.items()} for state in slices]
        reference = {n: t for n, t in reference.items() if not n.startswith("lm_head.")}
    state = join_tensor_parallel(slices, reference)
    save_exported(out, state, config, KINDS[run["objective"]],
                  os.path.join(run["data"], "tokenizer.json"), source=step_dir)
    return step_dir


def save_exported(out: str, state: Dict[str, Tensor], config: ModelConfig, kind: str,
                  tokenizer: str, source: str) -> None:
    """model.safetensors, config.json and tokenizer.json in `out`, which appears when complete."""
    with replacing_folder(out) as folder:
        save_file({n: t.contiguous() for n, t in state.items()},
                  os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"kind": kind, "model": dataclasses.asdict(config), "source": source}, f,
                      indent=1)
        shutil.copy(tokenizer, folder)


def read_export_description(directory: str) -> dict:
    """config.json of a tupe-export folder; ExportError naming the fix for anything else."""
    if not os.path.isdir(directory):
        raise ExportError(f"{directory}: no such folder; give a folder written by tupe-export")
    if not os.path.exists(os.path.join(directory, "config.json")):
        if os.path.exists(os.path.join(directory, "run.json")) or os.path.isdir(
                os.path.join(directory, "checkpoints")):
            raise ExportError(f"{directory} is a tupe-pretrain run, not an exported model: run "
                              f"tupe-export {directory} --out EXPORT_DIR, then give EXPORT_DIR")
        raise ExportError(f"{directory}: not a tupe-export folder (no config.json); tupe-export "
                          "RUN_DIR --out DIR writes one from a pretraining run")
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def load_exported(directory: str):
    """(model, config, kind) from a tupe-export folder: a BertForMaskedLM on this process's
    device, its masked-LM head absent (left at its initial values) for ELECTRA exports."""
    description = read_export_description(directory)
    config = ModelConfig(**description["model"])
    model = build_model(config)
    state = load_file(os.path.join(directory, "model.safetensors"), device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = ("lm_head.",) if description["kind"] == "electra-discriminator" else ()
    missing = [n for n in missing if not n.endswith("_extra_state") and not n.startswith(allowed)]
    if missing or unexpected:
        raise ExportError(f"{directory}: does not fit {config.pos_encoding} {config.num_layers} "
                          f"layers: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model, config, description["kind"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tupe-export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="RUN_DIR, RUN_DIR/checkpoints (its latest) or .../stepN")
    p.add_argument("--out", required=True, help="folder to write (replaced when complete)")
    args = p.parse_args(argv)
    try:
        step_dir = export(args.checkpoint, args.out)
    except ExportError as error:
        print(f"tupe-export: error: {error}", file=sys.stderr)
        return 2
    print(f"exported {step_dir} -> {args.out} (model.safetensors, config.json, tokenizer.json)")
    end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
