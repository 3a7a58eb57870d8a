"""The positional encodings: what each variant adds to the attention of every layer.

TUPE (Ke et al., "Rethinking Positional Encoding in Language Pre-training", ICLR 2021) is
written here by hand, since no library has it. Per head h, with d the head size and n the
sequence length:

    v_ij = (LN(p_i) U^Q_h)(LN(p_j) U^K_h)^T / sqrt(2d)          untied absolute term  (Eq. 7)
         + b_h(bucket(j - i))                                     TUPE-R only          (Eq. 8)
    v[0, :] = theta1_h,  v[1:, 0] = theta2_h                      [CLS] reset          (Eq. 9)
    theta_k = (LN(p_thk) U^Q_h)(LN(p_thk) U^K_h)^T / sqrt(2d)     (appendix B)

v depends on positions only: it is computed once per forward as [heads, n, n] and every layer adds
it to its word logits. p, its LayerNorm, U^Q/U^K, theta and the relative table are one set of
parameters shared by all layers. Under tensor parallelism each rank holds the heads it computes:
U^Q/U^K are column-parallel, the relative table and theta follow them; p is replicated and its
gradient, which flows back through the column-parallel U, is all-reduced by megatron-core.

Deliberate deviations from the public fairseq code (documented in docs/model.md): theta comes from two
learned vectors p_th1/p_th2 as in appendix B (not from an extra position row), U has no bias, and
the reset overwrites the summed v (Eq. 11) rather than using dedicated relative buckets.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from tupe_ds.model import kernel_layout
from tupe_ds.model.config import ModelConfig


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
        self.longest = config.max_position_embeddings
        # bucket(j - i) of the distances 1 - N ... N - 1 (N the longest sequence): made once, not
        # saved; a shorter n reads the middle 2n - 1
        self.register_buffer("buckets", self._relative_position_bucket(
            torch.arange(1 - self.longest, self.longest), bidirectional=True,
            num_buckets=config.relative_buckets, max_distance=config.relative_max_distance),
            persistent=False)

    def forward(self, n: int) -> Tensor:
        """[heads, n, n] with [h, i, j] = b_h(bucket(j - i)).

        Looked up once per distance (2n - 1 rows, not n^2 pairs) and laid out as a Toeplitz
        matrix through a strided view: the backward then sums over 2n - 1 rows too.
        """
        bucket = self.buckets[self.longest - n:self.longest + n - 1]
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


NO_POSITIONAL_LOGITS = {  # why an encoding has no content-free logits v, for the error message
    "bert-a": "positions are added to the input embedding",
    "nope": "it has no positional information",
    "mask-nope": "positions come only from the causal mask of the first layers",
    "rope": "rotary embeddings rotate q and k, so every logit depends on content",
}


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
                + NO_POSITIONAL_LOGITS[self.config.pos_encoding]
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

    def attention_bias(self, n: int, padding: Optional[Tensor], dtype: torch.dtype,
                       device: torch.device) -> kernel_layout.Layout:
        """How this batch's positional terms and padding reach every layer's attention (one
        object for all layers; model/kernel_layout.py decides the form). padding: [b, n] True at
        padded positions, or None when no sample of the batch is padded."""
        if self.config.attention == "dense":
            layout = kernel_layout.dense_layout(self, n, padding, dtype, device)
        else:
            layout = kernel_layout.fast_layout(self, n, padding, dtype, device)
        if self.encoding.untied_cross:  # BERT-A^d: LN(p)U^Q, LN(p)U^K added to q, k
            query, key = self.untied.positions(n)  # [heads, n, d_head]
            layout = kernel_layout.AddedPositions(query.unsqueeze(0).to(dtype),
                                                  key.unsqueeze(0).to(dtype), layout)
        return layout

    def untied_columns(self, n: int) -> tuple[Tensor, Tensor]:
        """TUPE-A's v as columns [1, heads, n, e]: (LN(p_i) U^Q)(LN(p_j) U^K)^T is a dot product
        already, and the [CLS] reset (Eq. 9) one more column:

            query  [pq_i, 1]     with pq_0 = 0 and the 1 absent at i = 0 (row 0: constant)
            key    [pk_j, t_j]   with pk_0 = 0 and t_0 = theta2 / scale, t_j = 0 for j > 0

        Row 0 of v becomes 0 rather than theta1: a constant added to a whole softmax row changes
        nothing (theta1's gradient is zero on the dense path too).
        """
        query, key = self.untied.positions(n)  # [heads, n, d_head]
        if self.encoding.cls_reset:
            others = (torch.arange(n, device=query.device) > 0).to(query.dtype)[:, None]  # [n, 1]
            _, theta2 = self.untied.cls_logits(self.scale)  # [heads]
            query = torch.cat([query * others, others.expand(query.shape[0], n, 1)], dim=-1)
            cls_column = F.pad((theta2 / self.scale)[:, None, None], (0, 0, 0, n - 1))
            key = torch.cat([key * others, cls_column], dim=-1)
        return query.unsqueeze(0), key.unsqueeze(0)

    def rotary_embedding(self, n: int) -> Optional[Tensor]:
        return self.rotary(n) if self.rotary is not None else None
