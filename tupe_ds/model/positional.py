"""The positional encodings: what each variant adds to the attention of every layer.

TUPE (Ke et al., ICLR 2021; ../shared/papers/tupe_paper.txt) is written here by hand, since no
library has it. Per head h, with d the head size and n the sequence length:

    v_ij = (LN(p_i) U^Q_h)(LN(p_j) U^K_h)^T / sqrt(2d)          untied absolute term  (Eq. 7)
         + b_h(bucket(j - i))                                     TUPE-R only          (Eq. 8)
    v[0, :] = theta1_h,  v[1:, 0] = theta2_h                      [CLS] reset          (Eq. 9)
    theta_k = (LN(p_thk) U^Q_h)(LN(p_thk) U^K_h)^T / sqrt(2d)     (appendix B)

v depends on positions only: it is computed once per forward as [heads, n, n] and every layer adds
it to its word logits. p, its LayerNorm, U^Q/U^K, theta and the relative table are one set of
parameters shared by all layers. Under tensor parallelism each rank holds the heads it computes:
U^Q/U^K are column-parallel, the relative table and theta follow them; p is replicated and its
gradient, which flows back through the column-parallel U, is all-reduced by megatron-core.

Deliberate deviations from the public fairseq code (documented in README): theta comes from two
learned vectors p_th1/p_th2 as in appendix B (not from an extra position row), U has no bias, and
the reset overwrites the summed v (Eq. 11) rather than using dedicated relative buckets.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from tupe_ds.model.config import ModelConfig


@dataclass
class AttentionBias:
    """What every layer's core attention receives, computed once per forward.

    mask:        additive logits [b or 1, heads or 1, n, n]: positional term, padding (and, for
                 mask-nope, `causal_mask` adds the causal triangle), in the activations' dtype.
    query, key:  BERT-A^d's positional query/key [n, 1, heads, d_head], added to each layer's q/k.
    """

    mask: Optional[Tensor] = None
    causal_mask: Optional[Tensor] = None
    query: Optional[Tensor] = None
    key: Optional[Tensor] = None


class UntiedPositions(nn.Module):
    """LN(p) projected by the per-head U^Q, U^K: the positional queries and keys of Eq. 7."""

    def __init__(self, config: ModelConfig, tconfig: TransformerConfig, cls_reset: bool):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads // config.tensor_parallel_size  # on this rank
        self.embedding = nn.Parameter(torch.empty(config.max_position_embeddings, d))  # p
        self.layernorm = nn.LayerNorm(d, eps=config.layernorm_epsilon)
        self.cls_vectors = nn.Parameter(torch.empty(2, d)) if cls_reset else None  # p_th1, p_th2
        linear = dict(config=tconfig, init_method=tconfig.init_method, bias=False,
                      gather_output=False)
        self.query = ColumnParallelLinear(d, d, **linear)  # U^Q, all heads side by side
        self.key = ColumnParallelLinear(d, d, **linear)  # U^K
        for weight in (self.embedding, self.cls_vectors):
            if weight is not None:
                tconfig.init_method(weight.data)

    def forward(self, vectors: Tensor) -> tuple[Tensor, Tensor]:
        """[m, d] position vectors -> queries and keys [heads, m, d_head]."""
        x = self.layernorm(vectors).unsqueeze(1)  # [m, 1, d]: megatron's [seq, batch, hidden]
        query, _ = self.query(x)
        key, _ = self.key(x)
        split = lambda t: t.view(t.shape[0], self.heads, -1).transpose(0, 1)  # noqa: E731
        return split(query), split(key)

    def positions(self, n: int) -> tuple[Tensor, Tensor]:
        return self(self.embedding[:n])

    def cls_logits(self, scale: float) -> tuple[Tensor, Tensor]:
        """theta1, theta2: [heads] each (appendix B)."""
        query, key = self(self.cls_vectors)  # [heads, 2, d_head]
        theta = (query * key).sum(-1) * scale  # [heads, 2]
        return theta[:, 0], theta[:, 1]


class RelativeBias(RelativePositionEmbedding):
    """T5 bidirectional bucketed bias, one scalar per head and bucket, shared by all layers.

    megatron-core's module holds a [buckets, heads] table; here it holds this rank's heads, cut
    from a table initialised whole so that every tensor-parallel size starts from the same values.
    """

    def __init__(self, config: ModelConfig, tconfig: TransformerConfig):
        heads = config.num_attention_heads
        tp = config.tensor_parallel_size
        with torch.random.fork_rng(devices=[]):  # its nn.Embedding draws a (tp-sized) init
            super().__init__(
                bidirectional=True,
                init_method=lambda weight: None,
                num_attention_heads=heads // tp,
                relative_attention_num_buckets=config.relative_buckets,
                relative_attention_max_distance=config.relative_max_distance,
            )
        table = torch.empty(config.relative_buckets, heads)
        tconfig.init_method(table)
        rank = parallel_state.get_tensor_model_parallel_rank()
        weight = self.relative_attention_bias.weight
        weight.data.copy_(table.chunk(tp, dim=1)[rank])
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=1, stride=1)

    def forward(self, n: int) -> Tensor:
        """[heads, n, n] with [h, i, j] = b_h(bucket(j - i)).

        Looked up once per distance (2n - 1 rows, not n^2 pairs) and laid out as a Toeplitz
        matrix through a strided view: the backward then sums over 2n - 1 rows too.
        """
        distance = torch.arange(1 - n, n, device=self.relative_attention_bias.weight.device)
        bucket = self._relative_position_bucket(
            distance,
            bidirectional=self.bidirectional,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        per_distance = self.relative_attention_bias(bucket).t()  # [heads, 2n - 1]
        # window k of unfold holds distances k - (n - 1) ... k; row i is window n - 1 - i.
        return per_distance.unfold(1, n, 1).flip(1)


class Rotary(RotaryEmbedding):
    """megatron-core's rotary embedding, which moves its frequencies to CUDA unconditionally.

    Without CUDA the same [n, 1, 1, d_head] embedding is built from its own frequencies.
    """

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        if torch.cuda.is_available():
            return super().get_emb(max_seq_len, offset)
        assert not self.rotary_interleaved
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [n, d_head / 2]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def reset_cls(v: Tensor, theta1: Tensor, theta2: Tensor) -> Tensor:
    """Eq. 9, in place: row 0 ([CLS] to all) becomes theta1, column 0 below it (all to [CLS])
    theta2. v: [heads, n, n], theta: [heads]."""
    v[:, 0, :] = theta1[:, None]
    v[:, 1:, 0] = theta2[:, None]
    return v


class PositionalEncoding(nn.Module):
    """Everything positional outside the input embedding, computed once per forward."""

    def __init__(self, config: ModelConfig, tconfig: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoding = enc = config.encoding
        self.scale = config.logit_scale
        has_untied = enc.untied or enc.untied_cross
        self.untied = UntiedPositions(config, tconfig, enc.cls_reset) if has_untied else None
        self.relative = RelativeBias(config, tconfig) if enc.relative else None
        self.rotary = (
            Rotary(config.head_size, rotary_percent=1.0, use_cpu_initialization=True)
            if enc.rotary else None
        )

    def content_free_logits(self, n: int) -> Tensor:
        """v: the position-only logits of this rank's heads, [heads, n, n]."""
        if not self.encoding.has_positional_logits:
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} has no content-free positional logits: "
                + {
                    "bert-a": "positions are added to the input embedding",
                    "nope": "it has no positional information",
                    "mask-nope": "positions come only from the causal mask of the first layers",
                    "rope": "rotary embeddings rotate q and k, so every logit depends on content",
                }[self.config.pos_encoding]
            )
        v = None
        if self.untied is not None:
            query, key = self.untied.positions(n)
            v = query @ key.transpose(1, 2) * self.scale  # [heads, n, n]
        if self.relative is not None:
            v = self.relative(n) if v is None else v + self.relative(n)
        if self.encoding.cls_reset:
            v = reset_cls(v, *self.untied.cls_logits(self.scale))
        return v

    def attention_bias(
        self, n: int, padding: Optional[Tensor], dtype: torch.dtype, device: torch.device
    ) -> AttentionBias:
        """The AttentionBias of a batch; padding is [b, n] with True at padded positions.

        The logits and masks are summed in fp32 and cast once to the activations' dtype.
        """
        enc = self.encoding
        mask = None
        if enc.untied or enc.relative:
            mask = self.content_free_logits(n).float().unsqueeze(0)  # [1, heads, n, n]
        if padding is not None:
            pad = torch.zeros(padding.shape, dtype=torch.float32, device=device)
            pad = pad.masked_fill(padding, torch.finfo(torch.float32).min).view(-1, 1, 1, n)
            mask = pad if mask is None else mask + pad
        bias = AttentionBias()
        if enc.causal_prefix:
            future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
            causal = torch.zeros(n, n, device=device).masked_fill(future, float("-inf"))
            bias.causal_mask = (causal if mask is None else mask + causal).to(dtype)
        if mask is not None:
            bias.mask = mask.clamp(min=torch.finfo(dtype).min).to(dtype)
        if enc.untied_cross:
            query, key = self.untied.positions(n)  # [heads, n, d_head]
            bias.query = query.transpose(0, 1).unsqueeze(1).to(dtype)  # [n, 1, heads, d_head]
            bias.key = key.transpose(0, 1).unsqueeze(1).to(dtype)
        return bias

    def rotary_embedding(self, n: int) -> Optional[Tensor]:
        return self.rotary(n) if self.rotary is not None else None
