"""A plain single-process BERT forward written from the papers, reading a model's weights by name.

Nothing here uses tupe_ds or megatron-core code: the attention logits follow the TUPE paper
(Eq. 2, 5, 7-11, appendix B), the T5 buckets follow Raffel et al., RoPE follows Su et al.
(rotate-half form), mask-nope follows Lost-or-Liberated Eq. 3. The layers are pre-LayerNorm
(megatron-core's layer): x + Attn(LN(x)), then x + MLP(LN(x)), a final LN, then the MLM head.
"""

import math

import torch
import torch.nn.functional as F


def t5_bucket(relative_position, num_buckets=32, max_distance=128):
    """T5 bidirectional bucket of j - i: half the buckets per direction, exact up to half of
    those, logarithmic up to max_distance, clipped beyond."""
    half = num_buckets // 2
    bucket = (relative_position > 0).long() * half
    distance = relative_position.abs()
    exact = half // 2
    log_bucket = exact + (
        torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact)
    ).long()
    log_bucket = log_bucket.clamp(max=half - 1)
    return bucket + torch.where(distance < exact, distance, log_bucket)


def rotate(x, n):
    """RoPE on [n, heads, d]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), base 10000."""
    d = x.shape[-1]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def layer_norm(x, w, prefix, eps):
    return F.layer_norm(x, x.shape[-1:], w[prefix + ".weight"], w[prefix + ".bias"], eps)


def positional_logits(w, config, n):
    """The content-free v of Eq. 9-11 for all heads: [heads, n, n], or None."""
    enc, H, d = config.pos_encoding, config.num_attention_heads, config.head_size
    eps = config.layernorm_epsilon
    v = None
    if enc in ("tupe-a", "tupe-r", "tupe-a-tie-cls", "bert-a-d"):
        scale = 1 / math.sqrt((4 if enc == "bert-a-d" else 2) * d)

        def project(vectors):  # LN(p) U^Q_h, LN(p) U^K_h: [heads, m, d]
            p = layer_norm(vectors, w, "encoder.positional.untied.layernorm", eps)
            q = p @ w["encoder.positional.untied.query.weight"].T
            k = p @ w["encoder.positional.untied.key.weight"].T
            return (t.view(-1, H, d).transpose(0, 1) for t in (q, k))

        pq, pk = project(w["encoder.positional.untied.embedding"][:n])
        v = torch.einsum("hid,hjd->hij", pq, pk) * scale  # Eq. 7
    if enc in ("bert-r", "tupe-r"):
        i = torch.arange(n)
        buckets = t5_bucket(i[None, :] - i[:, None])  # j - i
        b = w["encoder.positional.relative.relative_attention_bias.weight"][buckets].permute(2, 0, 1)
        v = b if v is None else v + b  # Eq. 5 / Eq. 8
    if enc in ("tupe-a", "tupe-r"):
        tq, tk = project(w["encoder.positional.untied.cls_vectors"])  # appendix B
        theta = (tq * tk).sum(-1) * scale  # [heads, 2]
        v = v.clone()
        v[:, 0, :] = theta[:, 0, None]  # Eq. 9: from [CLS] to all
        v[:, 1:, 0] = theta[:, 1, None]  # from the others to [CLS]
    return v


def reference_logits(model, input_ids, attention_mask=None):
    """MLM logits [b, n, vocab] of `model` computed from its weights only."""
    config = model.model_config
    w = {name: p.detach().float() for name, p in model.named_parameters()}
    enc, H, d = config.pos_encoding, config.num_attention_heads, config.head_size
    eps = config.layernorm_epsilon
    b, n = input_ids.shape
    x = w["embedding.word_embeddings.weight"][input_ids]  # [b, n, hidden]
    if enc in ("bert-a", "bert-r"):
        x = x + w["embedding.position_embeddings.weight"][:n]  # Eq. 3: w + p at the input
    v = positional_logits(w, config, n)
    if enc == "bert-a-d":
        p = layer_norm(w["encoder.positional.untied.embedding"][:n], w,
                       "encoder.positional.untied.layernorm", eps)
        pq = (p @ w["encoder.positional.untied.query.weight"].T).view(n, H, d)
        pk = (p @ w["encoder.positional.untied.key.weight"].T).view(n, H, d)
    scale = 1 / math.sqrt({"tupe-a": 2, "tupe-r": 2, "tupe-a-tie-cls": 2, "bert-a-d": 4}.get(enc, 1) * d)
    keep = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    for layer in range(config.num_layers):
        pre = f"encoder.block.layers.{layer}."
        h = layer_norm(x, w, pre + "input_layernorm", eps)
        qkv = h @ w[pre + "self_attention.linear_qkv.weight"].T + w[pre + "self_attention.linear_qkv.bias"]
        q, k, val = qkv.view(b, n, H, 3, d).unbind(3)  # megatron's per-head [q k v] layout
        if enc == "rope":
            q, k = rotate(q, n), rotate(k, n)
        if enc == "bert-a-d":  # (x W^Q + p U^Q)(x W^K + p U^K)^T: all four terms of Eq. 6
            q, k = q + pq, k + pk
        logits = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # word term
        if v is not None and enc != "bert-a-d":
            logits = logits + v  # Eq. 8 / 10 / 11
        allowed = keep[:, None, None, :]
        if enc == "mask-nope" and layer < config.causal_layers:
            allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
        logits = logits.masked_fill(~allowed, float("-inf"))
        context = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), val).reshape(b, n, H * d)
        proj = pre + "self_attention.linear_proj."
        x = x + context @ w[proj + "weight"].T + w[proj + "bias"]
        h = layer_norm(x, w, pre + "pre_mlp_layernorm", eps)
        h = F.gelu(h @ w[pre + "mlp.linear_fc1.weight"].T + w[pre + "mlp.linear_fc1.bias"])
        x = x + h @ w[pre + "mlp.linear_fc2.weight"].T + w[pre + "mlp.linear_fc2.bias"]
    x = layer_norm(x, w, "encoder.block.final_layernorm", eps)
    x = F.gelu(x @ w["lm_head.dense.weight"].T + w["lm_head.dense.bias"])
    x = layer_norm(x, w, "lm_head.layer_norm", eps)
    return x @ w["embedding.word_embeddings.weight"].T + w["lm_head.output_layer.bias"]  # tied decoder
