"""The configuration of a TUPE model for transformers (written by tupe_ds's `tupe-export`).

`encoding` lists the terms the positional encoding `pos_encoding` is made of, so that the model
file needs no table of encodings: tupe-export writes them from tupe_ds's ENCODINGS.
"""

from transformers import PreTrainedConfig

ENCODING_TERMS = {  # term: what it adds (TUPE paper, Ke et al. 2021)
    "input_absolute": "learned p added to the word embedding (BERT-A, BERT-R)",
    "untied": "(LN(p_i) U^Q)(LN(p_j) U^K)^T added to the logits (Eq. 7)",
    "untied_cross": "LN(p) U^Q and LN(p) U^K added to every layer's q and k (BERT-A^d)",
    "relative": "T5 bucketed bias b_h(j - i) added to the logits (Eq. 5, 8)",
    "cls_reset": "[CLS] row and column of the positional logits reset (Eq. 9)",
    "rotary": "rotary embedding of q and k",
    "causal_prefix": "causal mask in the first `causal_layers` layers",
    "logit_terms": "the word logits are scaled by 1/sqrt(logit_terms * d_head)",
}


class TupeConfig(PreTrainedConfig):
    model_type = "tupe"

    vocab_size: int = 32768
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    embedding_size: int | None = None  # the word embedding's width; None: hidden_size
    max_position_embeddings: int = 512
    # The pretraining's sequence length: longer inputs are refused (their positions were never
    # trained; set it to None to run them anyway). None: max_position_embeddings.
    seq_length: int | None = None
    # The tokenizer's vocabulary: the rows from it up to vocab_size pad the embedding (to a
    # multiple for tensor parallelism) and are masked out of the masked-LM logits.
    tokenizer_vocab_size: int | None = None
    pos_encoding: str = "nope"
    encoding: dict | None = None  # ENCODING_TERMS -> value; None: no positional term at all
    causal_layers: int | None = None
    relative_buckets: int = 32
    relative_max_distance: int = 128
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_dropout: float | None = None  # None: hidden_dropout_prob
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True
    tupe_ds: dict | None = None  # what tupe_ds reads back: its ModelConfig, the export kind

    def __post_init__(self, **kwargs):
        terms = {term: (1 if term == "logit_terms" else False) for term in ENCODING_TERMS}
        unknown = sorted(set(self.encoding or {}) - set(terms))
        if unknown:
            raise ValueError(f"TupeConfig.encoding: unknown term(s) {', '.join(unknown)}; "
                             f"known: {', '.join(terms)}")
        self.encoding = {**terms, **(self.encoding or {})}
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"TupeConfig.hidden_size: {self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.encoding["causal_prefix"] and not self.causal_layers:
            self.causal_layers = 1
        super().__post_init__(**kwargs)
