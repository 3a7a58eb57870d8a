"""A tupe_ds model as a folder transformers loads (`AutoModel*.from_pretrained(DIR,
trust_remote_code=True)`, `AutoTokenizer.from_pretrained(DIR)`), and back.

Written here because no library converts megatron-core's parameters to a custom transformers
model: the names are mapped both ways by one table, and megatron's fused QKV (per head
[q k v]) is split into query, key and value.
"""

import dataclasses
import json
import os
import re
import shutil
from typing import Dict, Optional

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing
import torch
from torch import Tensor

HERE = os.path.dirname(os.path.abspath(__file__))
CODE_FILES = ("configuration_tupe.py", "modeling_tupe.py")
HEADS = {  # export kind: (architecture, the Auto class of its pretraining head)
    "bert-mlm": ("TupeForMaskedLM", "AutoModelForMaskedLM"),
    "electra-generator": ("TupeForMaskedLM", "AutoModelForMaskedLM"),
    "electra-discriminator": ("TupeForPreTraining", "AutoModelForPreTraining"),
}
NAMES = [  # tupe_ds's BertForMaskedLM (or ELECTRA network) <-> modeling_tupe.py, first match
    ("embedding.word_embeddings.weight", "tupe.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "tupe.position_embeddings.weight"),
    ("generator_projection.{p}", "tupe.embedding_projection.{p}"),
    ("encoder.positional.relative.relative_attention_bias.weight",
     "tupe.positional.relative_bias.weight"),
    ("encoder.positional.untied.{p}", "tupe.positional.{p}"),
    ("encoder.block.layers.{i}.input_layernorm.{p}", "tupe.layers.{i}.attention_norm.{p}"),
    ("encoder.block.layers.{i}.self_attention.linear_proj.{p}",
     "tupe.layers.{i}.attention.output.{p}"),
    ("encoder.block.layers.{i}.self_attention.linear_qkv.{p}",
     "tupe.layers.{i}.attention.{qkv}.{p}"),
    ("encoder.block.layers.{i}.pre_mlp_layernorm.{p}", "tupe.layers.{i}.mlp_norm.{p}"),
    ("encoder.block.layers.{i}.mlp.linear_fc1.{p}", "tupe.layers.{i}.fc1.{p}"),
    ("encoder.block.layers.{i}.mlp.linear_fc2.{p}", "tupe.layers.{i}.fc2.{p}"),
    ("encoder.block.final_layernorm.{p}", "tupe.final_norm.{p}"),
    ("lm_head.output_layer.bias", "lm_head.bias"),
    ("lm_head.{p}", "lm_head.{p}"),
    ("discriminator_head.{p}", "discriminator_head.{p}"),
]
QKV = ("query", "key", "value")
CONFIG_NAMES = {  # TupeConfig's name: ModelConfig's
    **{name: name for name in ("vocab_size", "hidden_size", "num_attention_heads",
                               "max_position_embeddings", "seq_length", "pos_encoding",
                               "causal_layers", "relative_buckets", "relative_max_distance")},
    "num_hidden_layers": "num_layers", "intermediate_size": "ffn_hidden_size",
    "hidden_dropout_prob": "hidden_dropout", "attention_probs_dropout_prob": "attention_dropout",
    "layer_norm_eps": "layernorm_epsilon", "initializer_range": "init_std",
}


def pattern(template: str) -> re.Pattern:
    fields = {"i": r"(?P<i>\d+)", "p": r"(?P<p>.+)", "qkv": r"(?P<qkv>query|key|value)"}
    return re.compile(re.sub(r"\\\{(\w+)\\\}", lambda m: fields[m.group(1)], re.escape(template))
                      + "$")


def renamed(name: str, forward: bool) -> tuple:
    """(the name on the other side, its fields), or ValueError for a name of neither model."""
    for tupe, hf in NAMES:
        source, target = (tupe, hf) if forward else (hf, tupe)
        match = pattern(source).match(name)
        if match:
            return target, match.groupdict()
    side = "tupe_ds" if forward else "transformers (modeling_tupe.py)"
    raise ValueError(f"parameter {name!r} has no counterpart: not a {side} TUPE model")


def to_transformers(state: Dict[str, Tensor], heads: int) -> Dict[str, Tensor]:
    """transformers' names and QKV layout for a tupe_ds state dict at tp=1."""
    converted = {}
    for name, tensor in state.items():
        target, fields = renamed(name, forward=True)
        if "{qkv}" not in target:
            converted[target.format(**fields)] = tensor
            continue
        per_head = tensor.view(heads, 3, -1, *tensor.shape[1:])  # megatron: per head [q k v]
        for index, part in enumerate(QKV):
            converted[target.format(qkv=part, **fields)] = per_head[:, index].flatten(0, 1)
    return converted


def from_transformers(state: Dict[str, Tensor], heads: int) -> Dict[str, Tensor]:
    """The inverse of to_transformers."""
    converted, fused = {}, {}
    for name, tensor in state.items():
        target, fields = renamed(name, forward=False)
        if "qkv" in fields:
            fused.setdefault(target.format(**fields), {})[fields["qkv"]] = tensor
        else:
            converted[target.format(**fields)] = tensor
    for name, parts in fused.items():
        if sorted(parts) != sorted(QKV):
            raise ValueError(f"{name}: needs query, key and value, has {', '.join(parts)}")
        stacked = [parts[p].view(heads, -1, *parts[p].shape[1:]) for p in QKV]
        converted[name] = torch.stack(stacked, dim=1).flatten(0, 2)
    return converted


def transformers_config(model: dict, encoding: dict, kind: str, embedding_size: int,
                        source: str, tokenizer_vocab_size: int) -> dict:
    """config.json for modeling_tupe.py from a ModelConfig (as a dict) and its encoding."""
    architecture, head = HEADS[kind]
    return {
        "model_type": "tupe",
        "architectures": [architecture],
        "auto_map": {"AutoConfig": "configuration_tupe.TupeConfig",
                     "AutoModel": "modeling_tupe.TupeModel",
                     head: f"modeling_tupe.{architecture}",
                     "AutoModelForSequenceClassification":
                         "modeling_tupe.TupeForSequenceClassification",
                     "AutoModelForTokenClassification": "modeling_tupe.TupeForTokenClassification"},
        **{name: model[ours] for name, ours in CONFIG_NAMES.items()},
        "embedding_size": embedding_size,
        "tokenizer_vocab_size": tokenizer_vocab_size,
        "encoding": encoding,
        "pad_token_id": 0,
        "tie_word_embeddings": kind != "electra-discriminator",
        "dtype": "float32",
        "tupe_ds": {"kind": kind, "model": model, "source": source},
    }


def tokenizer_vocab_size(tokenizer_path: str, vocab_size: int) -> int:
    """The tokens of the pretraining data's tokenizer, at most the model's vocabulary."""
    tokens = Tokenizer.from_file(tokenizer_path).get_vocab_size()
    if tokens > vocab_size:
        raise ValueError(f"{tokenizer_path}: {tokens} tokens, more than the model's "
                         f"vocabulary of {vocab_size}: not the model's tokenizer")
    return tokens


def tokenizer_files(tokenizer_path: str, folder: str, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for
    PreTrainedTokenizerFast: the pretraining data's tokenizer, adding "[CLS] a [SEP]" /
    "[CLS] a [SEP] b [SEP]" as the samples were, and [MASK] taking the space before it, as a
    masked token did (byte-level BPE puts a word's space in its token); `max_length`: the
    pretraining's sequence length."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.add_special_tokens([AddedToken("[MASK]", lstrip=True, normalized=False,
                                             special=True)])  # updates the existing [MASK]
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    special = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
               "sep_token": "[SEP]", "mask_token": "[MASK]"}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                "model_input_names": ["input_ids", "attention_mask"], "padding_side": "right",
                "clean_up_tokenization_spaces": False, **special}
    for name, content in (("tokenizer_config.json", settings),
                          ("special_tokens_map.json", special)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=1)


def write_folder(folder: str, state: Dict[str, Tensor], config, kind: str, tokenizer: str,
                 source: str, embedding_size: int, masking: Optional[dict] = None) -> None:
    """A transformers folder in `folder` (which the caller makes appear complete) from a tupe_ds
    state dict at tp=1 and its ModelConfig; `masking`: the pretraining's, for the model card."""
    weights = to_transformers(state, config.num_attention_heads)
    save_file({n: t.contiguous() for n, t in weights.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tokens = tokenizer_vocab_size(tokenizer, config.vocab_size)
    description = transformers_config(dataclasses.asdict(config),
                                      dataclasses.asdict(config.encoding), kind, embedding_size,
                                      source, tokens)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(description, f, indent=1)
    for name in CODE_FILES:
        shutil.copy(os.path.join(HERE, name), folder)
    tokenizer_files(tokenizer, folder, config.seq_length)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(model_card(description, masking))


def model_card(description: dict, masking: Optional[dict] = None) -> str:
    """README.md of the folder: what the model is, how it was pretrained (`masking`, a
    MaskingScheme as a dict; None: not recorded) and the limits its config enforces."""
    kind, model = description["tupe_ds"]["kind"], description["tupe_ds"]["model"]
    padding = description["vocab_size"] - description["tokenizer_vocab_size"]
    padding_rows = (f"; the embedding's {padding} rows after them pad it to a multiple for "
                    "tensor parallelism, and the masked-LM head never predicts them"
                    if padding else "")
    return f"""---
library_name: transformers
tags: [tupe, tupe_ds]
---
# {model["pos_encoding"]} {kind}, exported by tupe_ds's tupe-export

Positional encoding `{model["pos_encoding"]}` (terms: {", ".join(
        term for term, value in description["encoding"].items() if value and term != "logit_terms"
    ) or "none"}), {description["num_hidden_layers"]} layers, hidden size
{description["hidden_size"]}; from `{description["tupe_ds"]["source"]}`. Load it with
`trust_remote_code=True` (the model's code is in this folder).

- **Sequence length.** Pretrained on sequences of {model["seq_length"]} tokens: the tokenizer's
  `model_max_length` is {model["seq_length"]}, and the model refuses longer inputs (the positions
  after it were never trained; `model.config.seq_length = None` runs them anyway).
- **Vocabulary.** {description["tokenizer_vocab_size"]} tokens{padding_rows}.
""" + (masking_item(kind, masking) if masking else "")


def masking_item(kind: str, masking: dict) -> str:
    """The model card's item on the pretraining's masking (tupe_ds/data/masking.py)."""
    def percent(share: float) -> str:
        return f"{share * 100:g}%"

    rate, mask, random = masking["probability"], masking["mask"], masking["random"]
    inputs = "The generator's inputs" if kind.startswith("electra") else "Its inputs"
    return f"""- **Masking.** {inputs} were masked as
  `tupe-pretrain --mask-rate {rate:g} --mask-split {mask:g},{random:g}` does: {percent(rate)}
  of each sample's tokens chosen for the loss, {percent(mask)} of them made `[MASK]`,
  {percent(random)} a random token and {percent(1 - mask - random)} left as they were.
"""
