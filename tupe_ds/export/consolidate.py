"""A checkpoint of any layout as one fp32 state dict of its model at tp=1: `consolidated_state`.

Each model-parallel slice (tensor-parallel rank x pipeline stage) becomes an fp32 state dict:
through DeepSpeed's zero_to_fp32 where ZeRO optimizer shards hold the fp32 weights (any ZeRO
stage, fp16/bf16 runs included), else from the saved module. Pipeline parameter names are mapped
back to BertForMaskedLM's, and tensor-parallel shards are joined along the dimension they were
split on. `network_state` names an ELECTRA network's parameters as a BertForMaskedLM's.
"""

import dataclasses
import fnmatch
import os
import re
import tempfile
from typing import Dict, List, Optional

import torch
from torch import Tensor

from tupe_ds.distributed.parallel import ensure_model_parallel
from tupe_ds.model.bert import BertForMaskedLM
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.electra import ElectraForPretraining
from tupe_ds.model.pipeline_names import bert_name
from tupe_ds.tools.errors import ExportError
from tupe_ds.tools.third_party_warnings import quietly
from tupe_ds.train.checkpoint import reads, safe_load


def files_named(folder: str, pattern: str) -> List[str]:
    """The paths of the files in `folder` whose names match the glob `pattern`, in name order;
    the listing retried (reads.list_folder; reads.Unreadable after the window): glob answers
    nothing for a folder it could not list, and a slice whose ZeRO shards went unseen would be
    exported from the module's fp16 weights."""
    return [os.path.join(folder, name)
            for name in sorted(fnmatch.filter(reads.list_folder(folder), pattern))]


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
            state = quietly(lambda: get_fp32_state_dict_from_zero_checkpoint(tmp, tag="slice"))
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
    if pp > 1:  # the pipeline's names mapped back to BertForMaskedLM's
        layer_indices = sorted({int(name.split(".")[0]) for state in slices for name in state
                                if name.split(".")[0].isdigit()})
        by_tp = [{} for _ in range(tp)]
        for rank, state in enumerate(slices):  # rank = stage * tp + tensor rank
            for name, tensor in state.items():
                name = bert_name(name, layer_indices, copies=False)
                if name is not None:  # None: the last stage's copy of the tied word embedding
                    by_tp[rank % tp][name] = tensor
        slices = by_tp
    return configs, join_tensor_parallel(slices, reference_state(configs))
