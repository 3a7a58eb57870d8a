"""BERT masked-LM model: token embedding -> positional module + encoder -> masked-LM head.

The public API takes and returns [batch, seq]; inside, megatron-core's [seq, batch, hidden].
"""

import dataclasses
from typing import Optional, Union

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from tupe_ds.model.config import ModelConfig
from tupe_ds.model.layers import (Encoder, MaskedLMHead, at_labelled, embed, masked_lm_loss,
                                  token_embedding)
from tupe_ds.distributed.parallel import (accelerator_device, ensure_model_parallel,
                                          gather_tensor_parallel, seed_tensor_parallel_rng)


class BertForMaskedLM(MegatronModule):
    def __init__(self, config: ModelConfig):
        tconfig = config.transformer_config()
        super().__init__(config=tconfig)
        self.model_config = config
        self.embedding = token_embedding(config, tconfig)
        self.encoder = Encoder(config, tconfig)
        self.lm_head = MaskedLMHead(config.hidden_size, config.hidden_size, config.vocab_size, tconfig)
        self.to(tconfig.params_dtype)  # the modules megatron-core does not build follow its dtype

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None, labelled: Optional[Tensor] = None,
        loss_denominator: Optional[Tensor] = None,
    ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """input_ids, attention_mask (1 = real token, 0 = padding; None when nothing is padded,
        which spares the attention kernels any mask), labels: [batch, seq].

        Returns logits [batch, seq, vocab], or (loss, logits): the loss summed over labels !=
        -100 and divided by `loss_denominator` (default: their count, the mean; training divides
        by the step's global count, train/normalization.py). With `labelled` (see
        labelled_positions) the masked-LM head runs on the labelled tokens only: the same loss
        and gradients for about 15% of the head's cost, and logits [m, vocab].
        """
        hidden = embed(self.embedding, input_ids, self.model_config.max_position_embeddings)
        padding = None if attention_mask is None else attention_mask == 0
        hidden = self.encoder(hidden, padding)  # [n, b, hidden]
        if labelled is not None:
            hidden = hidden.flatten(0, 1)[labelled].unsqueeze(1)  # [m, 1, hidden]
            labels = at_labelled(labels, labelled).unsqueeze(0)  # [1, m]
        logits = self.lm_head(hidden, self.embedding.word_embeddings.weight)  # [n, b, vocab / tp]
        full_logits = gather_tensor_parallel(logits, dim=-1).transpose(0, 1)
        if labelled is not None:
            full_logits = full_logits.squeeze(0)
        if labels is None:
            return full_logits
        return masked_lm_loss(logits, labels.transpose(0, 1), loss_denominator), full_logits

    def positional_scores(self, n: int) -> Tensor:
        """[heads, n, n]: see Encoder.positional_scores."""
        return self.encoder.positional_scores(n)


def build_model(preset_or_config: Union[str, ModelConfig] = "bert-base", **overrides) -> BertForMaskedLM:
    """A BertForMaskedLM on this process's accelerator, e.g. build_model("tiny", pos_encoding="rope").

    Overrides are ModelConfig field names. Without a launcher this sets up megatron-core's parallel
    state for tp=1; under one, torch.distributed must be initialised first. Weights come from
    torch's generator (seed it alike on every rank: torch.manual_seed), and each tensor-parallel
    rank's attention dropout from a generator seeded from it (parallel.seed_tensor_parallel_rng).
    """
    if isinstance(preset_or_config, ModelConfig):
        config = dataclasses.replace(preset_or_config, **overrides)
    else:
        config = ModelConfig.from_preset(preset_or_config, **overrides)
    ensure_model_parallel(config.tensor_parallel_size)
    seed_tensor_parallel_rng(torch.initial_seed())
    return BertForMaskedLM(config).to(accelerator_device())
