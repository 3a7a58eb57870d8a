"""How the positional terms and the key padding reach torch's SDPA: each layout as a type, and
which one a batch gets. The math of the terms is model/positional.py's; this is policy only.

Why the layouts are what they are (the one place this is written down):
- Kernel rules, read in PyTorch's `sdp_utils.cpp` (CUDA): the flash kernel takes no attn_mask and
  one head size for q, k and v; cuDNN's takes no mask with a gradient, q/k and v head sizes of at
  most 128 (256 on Hopper with cuDNN >= 9.10) and multiples of 8; the memory-efficient kernel takes
  an additive mask with its gradient and any head size that is a multiple of 8. The CPU kernels
  take everything. Which kernel runs for our exact shapes on a GPU is not measured yet.
- Measured once (bench/results/h100-a01eb4b.md, one H100, 2026-11-23, commit a01eb4b, one
  attention call forward + backward at BERT-Large shapes, bf16, dropout 0.1): no mask 0.614 ms; q/k
  of head size 128 with v of 64: 0.554; q/k of 136: 0.950; an additive [1, heads, n, n] bias with
  its gradient: 1.348. So a content-free term goes as q/k columns where its rank allows (TUPE-A), as
  a mask where it does not (the T5 relative term is a Toeplitz matrix of full rank).
- TUPE-A's width: content (d) + positional (d) + the [CLS] reset's one column = 2d + 1 (129 for
  d = 64), and no exact layout of width 2d exists: per query, column 0 must get theta2 on top of
  terms that depend on the tokens, and a softmax forgives only a constant per row, so the logits
  [n - 1, n] of the rows i > 0 have rank 2d + 1 for generic tokens. tupe-a-tie-cls has exactly 2d.
- Widened heads are zero-padded to a multiple of `head_multiple`: 8, the alignment every CUDA
  kernel above asks for (64 would give 192 for BERT-Large, 1.41x the q/k work of 136, on a kernel
  no measurement picked). bench/attention.py times 8 against 64 on the next GPU.
- Key padding, `ModelConfig.key_padding` (real batches are almost all padded: bench/README.md,
  padding.py): a [b, 1, 1, n] mask; one more q/k column (query a, key -a at padded keys, a^2 =
  PADDING_DROP / scale); or the real tokens only as jagged nested tensors, which SDPA takes without
  a mask. "auto" (the default) takes the column where q/k are widened or a positional mask is
  there anyway, else the mask; which is fastest on a GPU is not measured yet (bench/attention.py).
"""

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

# A padded key's logit drops by this much through the padding column: its softmax weight is then
# exactly 0 in fp32 while a row's real logits lie within ~890 of each other. Unscaled, the
# column's product is PADDING_DROP / scale (11,314 at TUPE's scale for d = 64): within fp16's
# range even where a kernel does not accumulate in fp32.
PADDING_DROP = 1e3


def sdpa(q, k, v, mask, causal: bool, dropout_p: float, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout_p,
                                          is_causal=causal and mask is None, scale=scale)


@dataclass(frozen=True)
class MaskedAttention:
    """q k^T * scale + mask: the dense reference, and the fast layout of terms of full rank.

    mask:        [b or 1, heads or 1, n, n] in the activations' dtype, or None.
    causal_mask: mask-nope's first layers where there is a mask: mask + the causal triangle.
    """

    mask: Optional[Tensor] = None
    causal_mask: Optional[Tensor] = None

    def attend(self, q, k, v, causal: bool, dropout_p: float, scale: float) -> Tensor:
        """q, k, v: [b, heads, n, d] -> [b, heads, n, d]."""
        mask = self.causal_mask if causal and self.causal_mask is not None else self.mask
        return sdpa(q, k, v, mask, causal and self.causal_mask is None, dropout_p, scale)


@dataclass(frozen=True)
class WidenedAttention:
    """[q, query_columns] [k, key_columns]^T * scale (+ mask): columns whose dot product adds a
    term of the logits (TUPE-A's positional term, the key padding), zero-padded to a multiple.

    query_columns: [1, heads, n, e];  key_columns: [b or 1, heads, n, e];
    mask:          the [1, heads, n, n] positional term of bert-r / tupe-r, or None.
    """

    query_columns: Tensor
    key_columns: Tensor
    mask: Optional[Tensor] = None

    def widen(self, q, k) -> tuple[Tensor, Tensor]:
        b = q.shape[0]
        return (torch.cat([q, self.query_columns.expand(b, -1, -1, -1)], dim=-1),
                torch.cat([k, self.key_columns.expand(b, -1, -1, -1)], dim=-1))

    def attend(self, q, k, v, causal: bool, dropout_p: float, scale: float) -> Tensor:
        if causal and self.mask is not None:
            raise ValueError("a causal layer with a positional mask: no encoding has both")
        q, k = self.widen(q, k)
        return sdpa(q, k, v, self.mask, causal, dropout_p, scale)


@dataclass(frozen=True)
class UnpaddedAttention:
    """The real tokens only: q, k, v as jagged nested tensors, so no padding and no mask reach the
    kernel; padded positions get zeros. PyTorch runs nested tensors with a gradient on the flash
    kernel, which wants one head size: widened q/k take v zero-padded to their width.

    real:    [t] the real tokens' positions in [b * n] (a row with none keeps its position 0,
             whose output no loss reads); found once per forward (one host synchronisation).
    offsets: [b + 1] where each row starts among them.
    columns: TUPE-A's WidenedAttention without padding columns, or None.
    causal:  mask-nope's first layers, which nested tensors cannot mask: a MaskedAttention.
    """

    real: Tensor
    offsets: Tensor
    columns: Optional[WidenedAttention] = None
    causal: Optional[MaskedAttention] = None

    def attend(self, q, k, v, causal: bool, dropout_p: float, scale: float) -> Tensor:
        if causal:
            return self.causal.attend(q, k, v, True, dropout_p, scale)
        if self.columns is not None:
            q, k = self.columns.widen(q, k)
        b, heads, n, d = v.shape
        v = F.pad(v, (0, q.shape[-1] - d))
        jagged = [torch.nested.nested_tensor_from_jagged(
            t.transpose(1, 2).flatten(0, 1)[self.real], self.offsets, min_seqlen=1, max_seqlen=n
        ).transpose(1, 2) for t in (q, k, v)]  # [b, heads, j, e]
        out = F.scaled_dot_product_attention(*jagged, dropout_p=dropout_p, scale=scale)
        values = out.transpose(1, 2).values()  # [t, heads, e]
        dense = values.new_zeros(b * n, heads, values.shape[-1]).index_copy(0, self.real, values)
        return dense.view(b, n, heads, -1).transpose(1, 2)[..., :d]


@dataclass(frozen=True)
class AddedPositions:
    """BERT-A^d: LN(p_i)U^Q and LN(p_j)U^K ([1, heads, n, d]) added to every layer's q and k, then
    `inner`'s layout."""

    query: Tensor
    key: Tensor
    inner: "Layout"

    def attend(self, q, k, v, causal: bool, dropout_p: float, scale: float) -> Tensor:
        return self.inner.attend(q + self.query, k + self.key, v, causal, dropout_p, scale)


Layout = Union[MaskedAttention, WidenedAttention, UnpaddedAttention, AddedPositions]


def head_multiple(config, device: torch.device) -> int:
    """Widened q/k heads are padded to a multiple of this: 8 on CUDA (see above), 1 elsewhere."""
    if config.head_multiple is not None:
        return config.head_multiple
    return 8 if device.type == "cuda" else 1


def untied_as_columns(config, device: torch.device) -> bool:
    """TUPE-A's term as q/k columns on CUDA; CPU kernels pay for head width in full and add a mask
    cheaply (the columns made attention 1.3x slower there: bench/README.md, attention.py)."""
    if config.untied_as_columns is not None:
        return config.untied_as_columns
    return device.type == "cuda"


def padding_logits(padding: Tensor) -> Tensor:
    """[b, n] True at padded keys -> additive fp32 logits [b, 1, 1, n]: fp32's minimum there."""
    b, n = padding.shape
    logits = torch.zeros(b, n, dtype=torch.float32, device=padding.device)
    return logits.masked_fill(padding, torch.finfo(torch.float32).min).view(b, 1, 1, n)


def additive(logits: Tensor, dtype) -> Tensor:
    """An additive mask in `dtype`, clamped to its range first: fp32's minimum or -inf cast to
    fp16 is -inf, and a row of padding only (every key masked) would be NaN after the softmax."""
    return logits.clamp(min=torch.finfo(dtype).min).to(dtype)


def causal_logits(n: int, device: torch.device) -> Tensor:
    """[n, n]: -inf above the diagonal (a query sees no later key), 0 elsewhere."""
    future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(n, n, device=device).masked_fill(future, float("-inf"))


def padding_columns(padding: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Padding as one more column: query a everywhere, key -a at padded keys and 0 at real ones,
    with a^2 * scale = PADDING_DROP. Returns query [1, 1, n, 1], key [b, 1, n, 1] (fp32)."""
    a = math.sqrt(PADDING_DROP / scale)
    b, n = padding.shape
    query = torch.full((1, 1, n, 1), a, device=padding.device)
    return query, padding.view(b, 1, n, 1) * -a


def join_columns(columns: list, heads: int, head_size: int, dtype: torch.dtype, multiple: int,
                 mask: Optional[Tensor]) -> WidenedAttention:
    """The (query [1, heads or 1, n, e], key [b or 1, heads or 1, n, e]) pieces side by side in
    `dtype`, zero-padded so that head_size plus their width is a multiple of `multiple`."""
    batch = max(key.shape[0] for _, key in columns)
    extra = -(head_size + sum(query.shape[-1] for query, _ in columns)) % multiple
    queries = [q.expand(1, heads, -1, -1).to(dtype) for q, _ in columns]
    keys = [k.expand(batch, heads, -1, -1).to(dtype) for _, k in columns]
    if extra:
        queries.append(queries[0].new_zeros(queries[0].shape[:-1] + (extra,)))
        keys.append(keys[0].new_zeros(keys[0].shape[:-1] + (extra,)))
    return WidenedAttention(torch.cat(queries, dim=-1), torch.cat(keys, dim=-1), mask)


def dense_layout(positional, n: int, padding: Optional[Tensor], dtype,
                 device: torch.device) -> MaskedAttention:
    """The reference: every term in one additive mask, summed in fp32 and cast once."""
    enc = positional.encoding
    mask = None
    if enc.untied or enc.relative:
        mask = positional.content_free_logits(n).float().unsqueeze(0)  # [1, heads, n, n]
    if padding is not None:
        mask = padding_logits(padding) if mask is None else mask + padding_logits(padding)
    causal_mask = None
    if enc.causal_prefix:
        causal = causal_logits(n, device)
        causal_mask = additive(causal if mask is None else mask + causal, dtype)
    if mask is not None:
        mask = additive(mask, dtype)
    return MaskedAttention(mask, causal_mask)


def unpadded(padding: Tensor, columns: Optional[WidenedAttention], causal_prefix: bool,
             dtype) -> UnpaddedAttention:
    real = ~padding
    real[:, 0] |= ~real.any(1)
    lengths = real.sum(1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    causal = None
    if causal_prefix:
        n = padding.shape[1]
        logits = padding_logits(padding) + causal_logits(n, padding.device)
        causal = MaskedAttention(causal_mask=additive(logits, dtype))
    return UnpaddedAttention(real.flatten().nonzero().squeeze(1), offsets, columns, causal)


def key_padding(choice: str, widened: bool, masked: bool) -> str:
    """The key-padding layout a padded batch gets (ModelConfig.key_padding, resolved)."""
    if choice == "auto":
        return "column" if widened or masked else "mask"
    if choice == "unpadded" and masked:  # nested tensors take no mask: bert-r, tupe-r
        return "column"
    return choice


def fast_layout(positional, n: int, padding: Optional[Tensor], dtype,
                device: torch.device) -> Layout:
    """What the fused kernels take without leaving them (the module's docstring says why)."""
    config, enc = positional.config, positional.encoding
    columns, mask = [], None  # column pieces (query, key); the [1, heads, n, n] positional term
    if enc.untied and not enc.relative and untied_as_columns(config, device):
        columns.append(positional.untied_columns(n))
    elif enc.untied or enc.relative:
        mask = additive(positional.content_free_logits(n).unsqueeze(0), dtype)
    how = None if padding is None else key_padding(config.key_padding, bool(columns),
                                                   mask is not None)
    heads = config.num_attention_heads // config.tensor_parallel_size
    multiple = head_multiple(config, device)
    if how == "unpadded":
        widened = join_columns(columns, heads, config.head_size, dtype, multiple, None) \
            if columns else None
        return unpadded(padding, widened, enc.causal_prefix, dtype)
    if how == "column":
        columns.append(padding_columns(padding, positional.scale))
    elif how == "mask":
        mask = padding_logits(padding) if mask is None else mask.float() + padding_logits(padding)
        mask = additive(mask, dtype)
    if columns:
        return join_columns(columns, heads, config.head_size, dtype, multiple, mask)
    causal_mask = None
    if enc.causal_prefix and mask is not None:
        causal_mask = additive(mask.float() + causal_logits(n, device), dtype)
    return MaskedAttention(mask, causal_mask)
