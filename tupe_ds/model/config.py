"""One validated configuration for every model this project builds.

`ModelConfig` holds what a researcher chooses (size, positional encoding, dropout, precision);
`transformer_config()` turns it into the megatron-core `TransformerConfig` its layers are built from.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from tupe_ds.distributed.parallel import accelerator_device


@dataclass(frozen=True)
class Encoding:
    """The pieces one positional encoding is made of (docs/model.md's table of encodings)."""

    input_absolute: bool = False  # learned p added to the word embedding (BERT)
    untied: bool = False  # (LN(p) U^Q)(LN(p) U^K)^T added to the logits (TUPE Eq. 7)
    untied_cross: bool = False  # LN(p) U^Q / LN(p) U^K added to each layer's q / k (BERT-A^d)
    relative: bool = False  # T5 bucketed bias b_h(j - i) added to the logits (Eq. 5, 8)
    cls_reset: bool = False  # [CLS] row and column of the positional logits reset (Eq. 9)
    rotary: bool = False  # rotary embedding of q and k
    causal_prefix: bool = False  # causal mask in the first `causal_layers` layers
    logit_terms: int = 1  # the word logits are scaled by 1/sqrt(logit_terms * d_head)

    @property
    def has_positional_logits(self) -> bool:
        """Whether there is a content-free [heads, n, n] term to compute once per forward."""
        return self.untied or self.untied_cross or self.relative


ENCODINGS = {
    "bert-a": Encoding(input_absolute=True),
    "bert-r": Encoding(input_absolute=True, relative=True),
    "tupe-a": Encoding(untied=True, cls_reset=True, logit_terms=2),
    "tupe-r": Encoding(untied=True, relative=True, cls_reset=True, logit_terms=2),
    "tupe-a-tie-cls": Encoding(untied=True, logit_terms=2),
    "bert-a-d": Encoding(untied_cross=True, logit_terms=4),
    "nope": Encoding(),
    "mask-nope": Encoding(causal_prefix=True),
    "rope": Encoding(rotary=True),
}

PRESETS = {
    "bert-base": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072),
    "bert-large": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096),
    "electra-base-discriminator": dict(num_layers=12, hidden_size=768, num_attention_heads=12,
                                       ffn_hidden_size=3072),
    "electra-base-generator": dict(num_layers=12, hidden_size=256, num_attention_heads=4,
                                   ffn_hidden_size=1024),
    # The tiny ELECTRA pair's generator is half the width of "tiny".
    "tiny-generator": dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                           vocab_size=512, max_position_embeddings=64, seq_length=64),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                 vocab_size=512, max_position_embeddings=64, seq_length=64),
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

ATTENTION = {
    "fast": "the layout the fused attention kernels run fastest (model/kernel_layout.py): on "
            "CUDA TUPE-A's positional term as extra query/key columns; no mask without "
            "padding, no [batch, heads, n, n] tensor",
    "dense": "the reference: every positional and padding term in one additive "
             "[batch or 1, heads or 1, n, n] mask",
}

COMPILE = {  # what torch.compile takes as one region (ModelConfig.compile)
    "block": "the encoder, its positional terms and every layer, forward and backward, as one "
             "region: the fewest Python calls and kernel launches a micro-batch (a pipeline "
             "stage compiles each of its layers instead)",
    "elementwise": "bias + dropout + residual and bias + GELU, each its own region (three a "
                   "layer), the rest eager",
    "none": "eager: the reference",
}

KEY_PADDING = {  # the fast layout's candidates for a padded batch (model/kernel_layout.py)
    "auto": "one more q/k column where q/k are widened or a positional mask is there anyway, "
            "else a [batch, 1, 1, n] mask",
    "mask": "a [batch, 1, 1, n] mask, added to the positional mask where there is one",
    "column": "one more q/k column (query a constant, key minus a large number at padded keys)",
    "unpadded": "the real tokens only, as nested (jagged) tensors, where no mask is needed; "
                "encodings with a positional mask (bert-r, tupe-r) keep the column",
}


@dataclass(frozen=True)
class ModelConfig:
    """A BERT-style encoder with one of the positional encodings in `ENCODINGS`."""

    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    ffn_hidden_size: int = 3072
    vocab_size: int = 32768
    max_position_embeddings: int = 512  # rows of p (and the longest sequence the model accepts)
    seq_length: int = 512  # the training sequence length; at most max_position_embeddings
    pos_encoding: str = "tupe-r"  # one of ENCODINGS
    causal_layers: Optional[int] = None  # mask-nope only: layers with a causal mask (default 1)
    relative_buckets: int = 32  # T5 bidirectional buckets (-r variants)
    relative_max_distance: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    tensor_parallel_size: int = 1
    dtype: str = "fp32"  # parameter dtype: fp32, fp16 or bf16
    attention: str = "fast"  # one of ATTENTION: how the positional term reaches the kernel
    key_padding: str = "auto"  # one of KEY_PADDING: how padded keys reach it (fast layout)
    # TUPE-A's positional term as q/k columns (True) or a [1, heads, n, n] mask (False) in the
    # fast layout; None: the device's choice (kernel_layout.untied_as_columns)
    untied_as_columns: Optional[bool] = None
    # widened q/k heads are zero-padded to a multiple of this; None: the device's choice
    # (kernel_layout.head_multiple)
    head_multiple: Optional[int] = None
    # one of COMPILE: what torch.compile takes as one region; None: the device's choice
    # (compile_mode)
    compile: Optional[str] = None

    def __post_init__(self):
        def require(condition, field, message):
            if not condition:
                raise ValueError(f"ModelConfig.{field}: {message}")

        for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "vocab_size", "max_position_embeddings", "seq_length",
                      "relative_buckets", "relative_max_distance", "tensor_parallel_size"):
            value = getattr(self, field)
            require(isinstance(value, int) and value > 0, field,
                    f"must be a positive integer, got {value!r}")
        for field, noun, choices in (("pos_encoding", "encoding", ENCODINGS),
                                     ("dtype", "dtype", DTYPES),
                                     ("attention", "attention", ATTENTION),
                                     ("key_padding", "key_padding", KEY_PADDING)):
            value = getattr(self, field)
            require(value in choices, field,
                    f"unknown {noun} {value!r}; choose one of {', '.join(choices)}")
        require(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                f"{self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}")
        require(self.num_attention_heads % self.tensor_parallel_size == 0, "num_attention_heads",
                f"{self.num_attention_heads} heads cannot be split over tensor_parallel_size="
                f"{self.tensor_parallel_size}; choose a tp that divides the number of heads")
        require(self.ffn_hidden_size % self.tensor_parallel_size == 0, "ffn_hidden_size",
                f"{self.ffn_hidden_size} cannot be split over tensor_parallel_size="
                f"{self.tensor_parallel_size}; choose a size that tp divides")
        require(self.vocab_size % self.tensor_parallel_size == 0, "vocab_size",
                f"{self.vocab_size} is not divisible by tensor_parallel_size="
                f"{self.tensor_parallel_size}")
        require(self.seq_length <= self.max_position_embeddings, "seq_length",
                f"{self.seq_length} is beyond max_position_embeddings="
                f"{self.max_position_embeddings}; lower seq_length or add positions")
        if self.encoding.causal_prefix:
            layers = 1 if self.causal_layers is None else self.causal_layers
            require(isinstance(layers, int) and 1 <= layers <= self.num_layers, "causal_layers",
                    f"must be between 1 and num_layers={self.num_layers}, got {layers!r}")
            object.__setattr__(self, "causal_layers", layers)
        else:
            require(self.causal_layers is None, "causal_layers",
                    f"only applies to pos_encoding='mask-nope', not {self.pos_encoding!r}")
        for field in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, field)
            require(0.0 <= value < 1.0, field, f"must be in [0, 1), got {value!r}")
        require(self.attention == "fast" or self.key_padding == "auto", "key_padding",
                f"{self.key_padding!r} applies to attention='fast' only (the dense reference "
                "puts padding into its mask)")
        require(self.compile is None or self.compile in COMPILE, "compile",
                f"unknown compile {self.compile!r}; choose one of {', '.join(COMPILE)}")
        if self.compile == "block":
            require(self.tensor_parallel_size == 1, "compile",
                    f"'block' at tensor_parallel_size={self.tensor_parallel_size}: megatron-core's "
                    "collectives split a compiled block (11 graphs for the tiny model's 2 "
                    "layers at tp 2); choose compile='none' (eager)")
            require(self.key_padding != "unpadded", "compile",
                    "'block' with key_padding='unpadded': nested tensors split a compiled block "
                    "at every layer; choose compile='none' (eager) or another key_padding")
        require(self.head_multiple is None
                or (isinstance(self.head_multiple, int) and self.head_multiple > 0),
                "head_multiple", f"must be None or a positive integer, got {self.head_multiple!r}")

    @classmethod
    def from_record(cls, fields: dict) -> "ModelConfig":
        """A ModelConfig as run.json, a manifest or an export recorded it, earlier tupe_ds's
        included (its `fused_elementwise`: True is compile="elementwise", False "none")."""
        fields = dict(fields)
        if "fused_elementwise" in fields:
            fused = fields.pop("fused_elementwise")
            fields.setdefault("compile", None if fused is None
                              else "elementwise" if fused else "none")
        return cls(**fields)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {', '.join(unknown)}; "
                             f"known fields: {', '.join(sorted(known))}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def encoding(self) -> Encoding:
        return ENCODINGS[self.pos_encoding]

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def logit_scale(self) -> float:
        """1/sqrt(d_head) for BERT, 1/sqrt(2 d_head) for TUPE (Eq. 7), 1/sqrt(4 d_head) for BERT-A^d."""
        return 1.0 / math.sqrt(self.encoding.logit_terms * self.head_size)

    @property
    def compile_mode(self) -> str:
        """`compile`, or the device's choice: on CUDA the whole block where it is one region
        (see __post_init__), else eager; eager on a CPU, where compiling takes longer than it
        saves. Not the elementwise regions: their guards and wrappers doubled the Python calls
        of a micro-batch (docs/performance.md, "What torch.compile takes as one region")."""
        if self.compile is not None:
            return self.compile
        whole = self.tensor_parallel_size == 1 and self.key_padding != "unpadded"
        return "block" if whole and accelerator_device().type == "cuda" else "none"

    def without_block(self) -> "ModelConfig":
        """This config, eager where it would compile the whole block (under ZeRO-3, whose hooks
        the block cannot hold: train/config.py)."""
        if self.compile_mode == "block":
            return dataclasses.replace(self, compile="none")
        return self

    @property
    def fuses_elementwise(self) -> bool:
        """Bias + dropout + residual and bias + GELU each in one compiled kernel, where the
        layer itself is not compiled whole."""
        return self.compile_mode == "elementwise"

    def transformer_config(self) -> TransformerConfig:
        """The megatron-core config of the encoder layers.

        Weights are initialised on the CPU from the full (unsplit) matrices, so the same seed gives
        the same model whatever the tensor-parallel size. Fusions that need Apex or Transformer
        Engine are off; megatron-core's torch.compile'd bias-dropout-add follows
        `compile_mode` "elementwise" (its bias-GELU is the tanh approximation: see attention.py).
        """
        dtype = DTYPES[self.dtype]
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.head_size,
            tensor_model_parallel_size=self.tensor_parallel_size,
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
            layernorm_epsilon=self.layernorm_epsilon,
            init_method_std=self.init_std,
            softmax_scale=self.logit_scale,
            activation_func=F.gelu,
            params_dtype=dtype,
            fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16,
            use_cpu_initialization=True,
            bias_dropout_fusion=self.fuses_elementwise,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
