"""Core attention that adds the positional logits, and the layer spec that uses it.

Written here because megatron-core's DotProductAttention refuses an additive bias; everything else
in a layer (QKV and output projections, MLP, LayerNorms, residuals) is megatron-core's local spec.
"""

import contextlib
import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core.jit import jit_fuser
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from tupe_ds.distributed.parallel import tensor_parallel_rng
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.kernel_layout import Layout


class BiasedCoreAttention(MegatronModule):
    """softmax(q k^T * scale + positional terms) v for this rank's heads, through torch's SDPA.

    `attention_bias` is the batch's kernel layout (model/kernel_layout.py), one object for every
    layer. Under tensor parallelism attention dropout is drawn from this rank's own generator:
    its heads are not the other ranks' heads. At tensor-parallel size 1 it is drawn from the
    default generator, as every other dropout: swapping generator states around each attention
    would cost two state copies a layer and split a compiled block (a generator's state is not
    traceable).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, softmax_scale: float,
                 causal_layers: int = 0, **unused_megatron_args):
        super().__init__(config=config)
        self.scale = softmax_scale
        self.causal = layer_number <= causal_layers  # mask-nope: the first K layers
        self.dropout = config.attention_dropout
        self.own_generator = config.tensor_model_parallel_size > 1

    def forward(self, query, key, value, attention_mask=None, attention_bias: Layout = None,
                **unused_megatron_args):
        # query, key, value: [n, b, heads, d_head] (megatron-core's layout)
        n, b, heads, d_head = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, n, d]
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel_rng() if dropout and self.own_generator else contextlib.nullcontext():
            context = attention_bias.attend(q, k, v, self.causal, dropout, self.scale)
        return context.permute(2, 0, 1, 3).reshape(n, b, heads * d_head)


@jit_fuser  # megatron-core's torch.compile
def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


class BiasGeluMLP(MLP):
    """megatron-core's MLP with the fc1 bias and the exact (erf) GELU in one compiled kernel.

    Written here because megatron-core's own bias-GELU fusion is the tanh approximation, which
    would change the model's math.
    """

    def forward(self, hidden_states, **unused_megatron_args):
        intermediate, bias = self.linear_fc1(hidden_states)  # [n, b, ffn / tp], bias apart
        return self.linear_fc2(bias_gelu(intermediate, bias))


class GroupedRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear, handing its own tensor-parallel group to its matmul.

    Written here because megatron-core 0.16.1's forward passes tp_group=None, and the function
    it calls then warns (a DeprecationWarning) before it looks the same group up: Python work
    in every layer, twice, and a break in a compiled block (dynamo does not trace warnings.warn).
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        return super()._forward_impl(input, weight, *args, **{**kwargs, "tp_group": self.tp_group})


def encoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """megatron-core's BERT layer with BiasedCoreAttention in the `core_attention` slot,
    GroupedRowParallelLinear as its row-parallel projections (and BiasGeluMLP as its MLP when
    elementwise operations are fused)."""
    spec = copy.deepcopy(bert_layer_local_spec)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = functools.partial(
        BiasedCoreAttention, causal_layers=config.causal_layers or 0
    )
    attention.linear_proj = GroupedRowParallelLinear
    spec.submodules.mlp.submodules.linear_fc2 = GroupedRowParallelLinear
    if config.fuses_elementwise:
        spec.submodules.mlp.module = BiasGeluMLP
    return spec
