"""Core attention that adds the positional logits, and the layer spec that uses it.

Written here because megatron-core's DotProductAttention refuses an additive bias; everything else
in a layer (QKV and output projections, MLP, LayerNorms, residuals) is megatron-core's local spec.
"""

import copy
import functools

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from tupe_ds.model.config import ModelConfig
from tupe_ds.model.positional import AttentionBias


class BiasedCoreAttention(MegatronModule):
    """softmax(q k^T * scale + bias) v for this rank's heads, through torch's fused SDPA.

    `attention_bias` is the AttentionBias of the batch, the same object for every layer.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, softmax_scale: float,
                 causal_layers: int = 0, **unused_megatron_args):
        super().__init__(config=config)
        self.scale = softmax_scale
        self.causal = layer_number <= causal_layers  # mask-nope: the first K layers
        self.dropout = config.attention_dropout

    def forward(self, query, key, value, attention_mask=None, attention_bias: AttentionBias = None,
                **unused_megatron_args):
        # query, key, value: [n, b, heads, d_head] (megatron-core's layout)
        if attention_bias.query is not None:  # BERT-A^d: q + LN(p)U^Q, k + LN(p)U^K
            query = query + attention_bias.query
            key = key + attention_bias.key
        mask = attention_bias.causal_mask if self.causal else attention_bias.mask
        n, b, heads, d_head = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, n, d_head]
        dropout = self.dropout if self.training else 0.0
        tracker = tensor_parallel.get_cuda_rng_tracker()
        if dropout and tracker.is_initialized():  # different heads, different dropout per tp rank
            with tracker.fork():
                context = F.scaled_dot_product_attention(q, k, v, mask, dropout, scale=self.scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, mask, dropout, scale=self.scale)
        return context.permute(2, 0, 1, 3).reshape(n, b, heads * d_head)


def encoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """megatron-core's BERT layer with BiasedCoreAttention in the `core_attention` slot."""
    spec = copy.deepcopy(bert_layer_local_spec)
    spec.submodules.self_attention.submodules.core_attention = functools.partial(
        BiasedCoreAttention, causal_layers=config.causal_layers or 0
    )
    return spec
