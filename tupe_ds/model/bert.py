"""BERT masked-LM model: token embedding -> positional module -> megatron-core encoder -> LM head.

Layout inside: megatron-core's [seq, batch, hidden]; the public API takes and returns [batch, seq].
"""

import dataclasses
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import Tensor

from tupe_ds.model.attention import encoder_layer_spec
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.positional import PositionalEncoding
from tupe_ds.parallel import accelerator_device, ensure_model_parallel, gather_tensor_parallel

IGNORE_INDEX = -100


class BertForMaskedLM(MegatronModule):
    def __init__(self, config: ModelConfig):
        tconfig = config.transformer_config()
        super().__init__(config=tconfig)
        self.model_config = config
        self.embedding = LanguageModelEmbedding(
            tconfig,
            vocab_size=config.vocab_size,
            max_sequence_length=config.max_position_embeddings,
            position_embedding_type="learned_absolute" if config.encoding.input_absolute else "none",
        )
        self.positional = PositionalEncoding(config, tconfig)
        self.encoder = TransformerBlock(tconfig, spec=encoder_layer_spec(config))
        self.lm_head = BertLMHead(config.hidden_size, tconfig)
        # The decoder's weight is the word embedding (tied); only its bias is its own.
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            config=tconfig,
            init_method=tconfig.init_method,
            bias=True,
            skip_weight_param_allocation=True,
            gather_output=False,
        )
        self.output_layer.bias.data.zero_()
        self.to(tconfig.params_dtype)  # the modules megatron-core does not build follow its dtype

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None
    ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """input_ids, attention_mask (1 = real token, 0 = padding), labels: [batch, seq].

        Returns logits [batch, seq, vocab], or (mean loss over labels != -100, logits).
        """
        hidden = self.encode(input_ids, attention_mask)
        logits, _ = self.output_layer(
            self.lm_head(hidden), weight=self.embedding.word_embeddings.weight
        )  # [seq, batch, vocab / tp]
        full_logits = gather_tensor_parallel(logits, dim=-1).transpose(0, 1)
        if labels is None:
            return full_logits
        labels = labels.transpose(0, 1)
        counted = labels != IGNORE_INDEX
        losses = tensor_parallel.vocab_parallel_cross_entropy(  # works in place on its input
            logits.to(torch.float32, copy=True), labels.masked_fill(~counted, 0)
        )
        loss = (losses * counted).sum() / counted.sum().clamp(min=1)
        return loss, full_logits

    def encode(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """The encoder's output, [seq, batch, hidden]."""
        batch, n = input_ids.shape
        if n > self.model_config.max_position_embeddings:
            raise ValueError(
                f"sequence length {n} is beyond max_position_embeddings="
                f"{self.model_config.max_position_embeddings}"
            )
        positions = torch.arange(n, device=input_ids.device).expand(batch, n)
        hidden = self.embedding(input_ids, positions)  # [n, b, h]
        padding = None if attention_mask is None else attention_mask == 0
        bias = self.positional.attention_bias(n, padding, hidden.dtype, hidden.device)
        return self.encoder(
            hidden,
            attention_mask=None,
            attention_bias=bias,
            rotary_pos_emb=self.positional.rotary_embedding(n),
        )

    def positional_scores(self, n: int) -> Tensor:
        """The content-free positional logits of every head, [heads, n, n] (the paper's Figure 6).

        Raises ValueError for encodings that have none (bert-a, nope, mask-nope, rope).
        """
        return gather_tensor_parallel(self.positional.content_free_logits(n), dim=0)


def build_model(preset_or_config: Union[str, ModelConfig] = "bert-base", **overrides) -> BertForMaskedLM:
    """A BertForMaskedLM on this process's accelerator, e.g. build_model("tiny", pos_encoding="rope").

    Overrides are ModelConfig field names. Without a launcher this sets up megatron-core's parallel
    state for tp=1; under one, torch.distributed must be initialised first.
    """
    if isinstance(preset_or_config, ModelConfig):
        config = dataclasses.replace(preset_or_config, **overrides)
    else:
        config = ModelConfig.from_preset(preset_or_config, **overrides)
    ensure_model_parallel(config.tensor_parallel_size)
    return BertForMaskedLM(config).to(accelerator_device())
