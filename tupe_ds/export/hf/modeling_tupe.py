"""TUPE (Ke et al., "Rethinking Positional Encoding in Language Pre-training", ICLR 2021) and the
encodings it is compared with, as a transformers model (written by tupe_ds's `tupe-export`).

Plain PyTorch and transformers. The layers are pre-LayerNorm (megatron-core's, where the
weights were trained): x + Attn(LN(x)), then x + MLP(LN(x)), a final LN. Per head h,

    logits_ij = (x_i W^Q)(x_j W^K)^T * scale + v_ij        softmax over j

where v is the content-free positional term of `config.encoding` (Eq. 7-11: the untied
(LN(p_i) U^Q)(LN(p_j) U^K)^T, the T5 relative bias, the [CLS] reset), computed once per forward
from parameters shared by all layers. v and the padding reach the attention as one additive
mask, which eager and SDPA attention both take; flash attention cannot take it, so the model
does not claim it. The model has no token-type embedding (neither had its pretraining):
`token_type_ids` is accepted and ignored. Inputs longer than the pretraining's sequence length
(`config.seq_length`) are refused, and the vocabulary's padding rows never win a masked-LM
prediction. Every additive mask is clamped to its dtype's range and eager attention takes its
softmax in fp32, so a row of padding only (all keys masked) stays finite in fp16.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput, ModelOutput,
                                           SequenceClassifierOutput, TokenClassifierOutput)

from .configuration_tupe import TupeConfig


def t5_bucket(relative, num_buckets, max_distance):
    """T5's bidirectional bucket of j - i: half the buckets per direction, exact up to half of
    those, logarithmic up to max_distance, clipped beyond (Raffel et al.)."""
    half = num_buckets // 2
    exact = half // 2
    distance = relative.abs()
    logarithmic = exact + (torch.log(distance.float().clamp(min=1) / exact)
                           / math.log(max_distance / exact) * (half - exact)).long()
    bucket = torch.where(distance < exact, distance, logarithmic.clamp(max=half - 1))
    return bucket + (relative > 0).long() * half


def rotate(x, cos, sin):
    """RoPE (Su et al.) on [..., n, d] in the rotate-half form."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class TupePositional(nn.Module):
    """The positional parameters every layer shares, and what they give for n positions."""

    def __init__(self, config: TupeConfig):
        super().__init__()
        self.config, terms, d = config, config.encoding, config.hidden_size
        self.heads = config.num_attention_heads
        self.head_size = d // self.heads
        self.scale = 1 / math.sqrt(terms["logit_terms"] * self.head_size)
        if terms["untied"] or terms["untied_cross"]:
            self.embedding = nn.Parameter(torch.zeros(config.max_position_embeddings, d))  # p
            self.layernorm = nn.LayerNorm(d, eps=config.layer_norm_eps)
            self.query = nn.Linear(d, d, bias=False)  # U^Q, all heads side by side
            self.key = nn.Linear(d, d, bias=False)  # U^K
        if terms["cls_reset"]:
            self.cls_vectors = nn.Parameter(torch.zeros(2, d))  # p_theta1, p_theta2 (appendix B)
        if terms["relative"]:
            self.relative_bias = nn.Embedding(config.relative_buckets, self.heads)

    def project(self, vectors):
        """[m, d] position vectors -> LN(p) U^Q, LN(p) U^K: [heads, m, d_head] each."""
        x = self.layernorm(vectors)
        return [t.view(len(vectors), self.heads, -1).transpose(0, 1)
                for t in (self.query(x), self.key(x))]

    def logits(self, n):
        """v, the content-free logits [heads, n, n] added to every layer's; None if none."""
        terms, v = self.config.encoding, None
        if terms["untied"]:
            query, key = self.project(self.embedding[:n])
            v = query @ key.transpose(1, 2) * self.scale  # Eq. 7
        if terms["relative"]:
            i = torch.arange(n, device=self.relative_bias.weight.device)
            buckets = t5_bucket(i[None, :] - i[:, None], self.config.relative_buckets,
                                self.config.relative_max_distance)
            bias = self.relative_bias(buckets).permute(2, 0, 1)  # Eq. 5, 8
            v = bias if v is None else v + bias
        if terms["cls_reset"]:  # Eq. 9: [CLS] to all is theta1, all others to [CLS] theta2
            query, key = self.project(self.cls_vectors)
            theta = (query * key).sum(-1) * self.scale  # [heads, 2]
            v = torch.cat([theta[:, 0, None, None].expand(-1, 1, n),
                           torch.cat([theta[:, 1, None, None].expand(-1, n - 1, 1),
                                      v[:, 1:, 1:]], dim=2)], dim=1)
        return v

    def rotary(self, n, dtype, device):
        """cos, sin [n, d_head] of RoPE with base 10000."""
        d = self.head_size
        inverse = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        angles = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inverse)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class TupeAttention(nn.Module):
    def __init__(self, config: TupeConfig, scale: float):
        super().__init__()
        h = config.hidden_size
        self.config, self.heads, self.scale = config, config.num_attention_heads, scale
        self.query, self.key, self.value, self.output = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x, mask, rotary, added, output_attentions):
        """x [b, n, h]; mask: additive [b or 1, heads or 1, n, n] or None; rotary: (cos, sin) or
        None; added: BERT-A^d's positional (query, key) [heads, n, d_head] or None."""
        b, n, _ = x.shape
        q, k, v = (layer(x).view(b, n, self.heads, -1).transpose(1, 2)  # [b, heads, n, d]
                   for layer in (self.query, self.key, self.value))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        if added is not None:  # (x W^Q + p U^Q)(x W^K + p U^K)^T: the four terms of Eq. 6
            q, k = q + added[0], k + added[1]
        dropout = self.config.attention_probs_dropout_prob if self.training else 0.0
        probabilities = None
        if self.config._attn_implementation == "sdpa" and not output_attentions:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     scale=self.scale)
        else:
            logits = (q @ k.transpose(-1, -2) * self.scale).float()  # fp16 + mask could be -inf
            probabilities = (logits if mask is None else logits + mask).softmax(-1).to(v.dtype)
            context = F.dropout(probabilities, dropout, self.training) @ v
        return self.output(context.transpose(1, 2).reshape(b, n, -1)), probabilities


class TupeLayer(nn.Module):
    def __init__(self, config: TupeConfig, scale: float):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.attention = TupeAttention(config, scale)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)
        self.fc1 = nn.Linear(h, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, h)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, mask, rotary, added, output_attentions):
        attended, probabilities = self.attention(self.attention_norm(x), mask, rotary, added,
                                                 output_attentions)
        x = x + self.dropout(attended)
        x = x + self.dropout(self.fc2(F.gelu(self.fc1(self.mlp_norm(x)))))
        return x, probabilities


class TupePreTrainedModel(PreTrainedModel):
    config_class = TupeConfig
    base_model_prefix = "tupe"
    _supports_sdpa = True  # v is SDPA's attn_mask; flash attention has no place for it

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, TupePositional):
            for name in ("embedding", "cls_vectors"):
                if hasattr(module, name):
                    init.normal_(getattr(module, name), mean=0.0, std=std)
        elif isinstance(module, TupeLMHead):
            init.zeros_(module.bias)


class TupeModel(TupePreTrainedModel):
    """Embedding, positional module, layers, final LayerNorm: the last hidden states."""

    def __init__(self, config: TupeConfig):
        super().__init__(config)
        e = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, e)
        if config.encoding["input_absolute"]:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, e)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout_prob)
        if e != config.hidden_size:  # ELECTRA's generator reads the shared embedding so
            self.embedding_projection = nn.Linear(e, config.hidden_size)
        self.positional = TupePositional(config)
        self.layers = nn.ModuleList(TupeLayer(config, self.positional.scale)
                                    for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, embeddings):
        self.word_embeddings = embeddings

    def embed(self, input_ids):
        n, config = input_ids.shape[1], self.config
        if n > config.max_position_embeddings:
            raise ValueError(f"{n} tokens, beyond max_position_embeddings="
                             f"{config.max_position_embeddings}: truncate the input")
        if config.seq_length is not None and n > config.seq_length:
            raise ValueError(
                f"{n} tokens, beyond the {config.seq_length} the model was pretrained on: the "
                f"positions after it were never trained. Truncate the input (the tokenizer's "
                f"model_max_length is {config.seq_length}), or set model.config.seq_length = "
                f"None to run it anyway")
        x = self.word_embeddings(input_ids)
        if self.config.encoding["input_absolute"]:
            x = x + self.position_embeddings(torch.arange(n, device=input_ids.device))
        x = self.embedding_dropout(x)
        return self.embedding_projection(x) if hasattr(self, "embedding_projection") else x

    def attention_masks(self, attention_mask, n, dtype, device):
        """The additive masks of the layers, (plain, causal): v plus minus-infinity where a key
        is padding (attention_mask 0), and above the diagonal for the causal ones."""
        mask, low = self.positional.logits(n), torch.finfo(dtype).min
        mask = None if mask is None else mask[None].to(dtype)
        if attention_mask is not None:
            padding = (attention_mask[:, None, None, :] == 0).to(dtype) * low
            mask = padding if mask is None else (mask + padding).clamp(min=low)
        if not self.config.encoding["causal_prefix"]:
            return mask, None
        future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
        causal = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(future, low)
        return mask, causal if mask is None else (mask + causal).clamp(min=low)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None,
                output_attentions=None, output_hidden_states=None, return_dict=None):
        """input_ids, attention_mask (1 real, 0 padding): [batch, n]."""
        config = self.config
        output_attentions = output_attentions or getattr(config, "output_attentions", False)
        output_hidden_states = output_hidden_states or config.output_hidden_states
        x = self.embed(input_ids)
        n, terms = x.shape[1], config.encoding
        mask, causal = self.attention_masks(attention_mask, n, x.dtype, x.device)
        rotary = self.positional.rotary(n, x.dtype, x.device) if terms["rotary"] else None
        added = None
        if terms["untied_cross"]:
            added = [t.to(x.dtype) for t in self.positional.project(self.positional.embedding[:n])]
        states, attentions = (x,), ()
        for index, layer in enumerate(self.layers):
            layer_mask = causal if index < (config.causal_layers or 0) else mask
            x, probabilities = layer(x, layer_mask, rotary, added, output_attentions)
            states, attentions = states + (x,), attentions + (probabilities,)
        x = self.final_norm(x)
        output = BaseModelOutput(
            last_hidden_state=x,
            hidden_states=states[:-1] + (x,) if output_hidden_states else None,
            attentions=attentions if output_attentions else None)
        return as_requested(output, return_dict)


def as_requested(output, return_dict):
    """A ModelOutput, or its tuple for return_dict=False."""
    return output if return_dict is not False else output.to_tuple()


class TupeLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embedding, with its own bias."""

    def __init__(self, config: TupeConfig):
        super().__init__()
        e = config.embedding_size
        self.dense = nn.Linear(config.hidden_size, e)
        self.layer_norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(e, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.tokens = config.tokenizer_vocab_size or config.vocab_size

    def forward(self, x):
        logits = self.decoder(self.layer_norm(F.gelu(self.dense(x)))) + self.bias
        if self.tokens < logits.shape[-1]:  # the vocabulary's padding rows: no token
            logits[..., self.tokens:] = torch.finfo(logits.dtype).min
        return logits


@dataclass
class TupeForPreTrainingOutput(ModelOutput):
    """ELECTRA's replaced-token detection: logits [batch, n] (> 0: replaced)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None


class TupeWithHead(TupePreTrainedModel):
    """TupeModel and a head on its last hidden states; subclasses set the head, its loss and
    the output class."""

    output_class = ModelOutput

    def head(self, hidden):
        raise NotImplementedError

    def loss(self, logits, labels, attention_mask):
        return self.loss_function(logits, labels, self.config)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                output_attentions=None, output_hidden_states=None, return_dict=None):
        """input_ids, attention_mask (1 real, 0 padding) [batch, n]; labels as the head's
        class says; token_type_ids ignored (the model has no token types)."""
        out = self.tupe(input_ids, attention_mask, None, output_attentions, output_hidden_states)
        logits = self.head(out.last_hidden_state)
        loss = None if labels is None else self.loss(logits, labels, attention_mask)
        return as_requested(self.output_class(loss=loss, logits=logits,
                                              hidden_states=out.hidden_states,
                                              attentions=out.attentions), return_dict)


def classifier_dropout(config):
    return nn.Dropout(config.hidden_dropout_prob if config.classifier_dropout is None
                      else config.classifier_dropout)


class TupeForMaskedLM(TupeWithHead):
    """labels [batch, n]: the token at masked positions, -100 elsewhere."""

    output_class = MaskedLMOutput
    _tied_weights_keys = {"lm_head.decoder.weight": "tupe.word_embeddings.weight"}

    def __init__(self, config: TupeConfig):
        super().__init__(config)
        self.tupe = TupeModel(config)
        self.lm_head = TupeLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, embeddings):
        self.lm_head.decoder = embeddings

    def head(self, hidden):
        return self.lm_head(hidden)

    def loss(self, logits, labels, attention_mask):
        return self.loss_function(logits, labels, self.config.vocab_size)


class TupeForSequenceClassification(TupeWithHead):
    """A head on the final state of [CLS]: dense, tanh, dropout, linear (tupe-finetune's).
    labels [batch]: class ids, or values with num_labels=1 (regression)."""

    output_class = SequenceClassifierOutput

    def __init__(self, config: TupeConfig):
        super().__init__(config)
        h = config.hidden_size
        self.tupe = TupeModel(config)
        self.classifier = nn.Sequential(nn.Linear(h, h), nn.Tanh(), classifier_dropout(config),
                                        nn.Linear(h, config.num_labels))
        self.post_init()

    def head(self, hidden):
        return self.classifier(hidden[:, 0])

    def loss(self, logits, labels, attention_mask):
        return self.loss_function(labels, logits, self.config)


class TupeForTokenClassification(TupeWithHead):
    """labels [batch, n]: a class per token, -100 where none."""

    output_class = TokenClassifierOutput

    def __init__(self, config: TupeConfig):
        super().__init__(config)
        self.tupe = TupeModel(config)
        self.classifier = nn.Sequential(classifier_dropout(config),
                                        nn.Linear(config.hidden_size, config.num_labels))
        self.post_init()

    def head(self, hidden):
        return self.classifier(hidden)


class TupeForPreTraining(TupeWithHead):
    """ELECTRA's discriminator: dense, GELU, one logit per token, whether it was replaced.
    labels [batch, n]: 1 where replaced, 0 where not (the mean binary cross-entropy over the
    real tokens, as in pretraining)."""

    output_class = TupeForPreTrainingOutput

    def __init__(self, config: TupeConfig):
        super().__init__(config)
        h = config.hidden_size
        self.tupe = TupeModel(config)
        self.discriminator_head = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, 1))
        self.post_init()

    def head(self, hidden):
        return self.discriminator_head(hidden).squeeze(-1)

    def loss(self, logits, labels, attention_mask):
        real = torch.ones_like(logits) if attention_mask is None else attention_mask.float()
        losses = F.binary_cross_entropy_with_logits(logits.float(), labels.float(),
                                                    reduction="none")
        return (losses * real).sum() / real.sum().clamp(min=1)
