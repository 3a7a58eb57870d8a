"""The pieces the BERT and ELECTRA models are made of: embedding, encoder, masked-LM head.

Layout inside: megatron-core's [seq, batch, hidden].
"""

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor
from torch import Tensor, nn

from tupe_ds.data.masking import IGNORE_INDEX
from tupe_ds.distributed.parallel import gather_tensor_parallel
from tupe_ds.model.attention import encoder_layer_spec
from tupe_ds.model.compiled import CompiledRegion, Graphs
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.positional import PositionalEncoding


def token_embedding(config: ModelConfig, tconfig: TransformerConfig) -> LanguageModelEmbedding:
    """Vocab-parallel word embedding (+ the learned absolute p for the BERT-A/R encodings)."""
    return LanguageModelEmbedding(
        tconfig,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="learned_absolute" if config.encoding.input_absolute else "none",
    )


def embed(embedding: LanguageModelEmbedding, input_ids: Tensor, max_positions: int) -> Tensor:
    """[batch, seq] ids -> [seq, batch, hidden]."""
    batch, n = input_ids.shape
    if n > max_positions:
        raise ValueError(f"sequence length {n} is beyond max_position_embeddings={max_positions}")
    return embedding(input_ids, torch.arange(n, device=input_ids.device).expand(batch, n))


class Encoder(MegatronModule):
    """The positional module and megatron-core's TransformerBlock: [n, b, h] -> [n, b, h].

    With ModelConfig.compile_mode "block" the positional terms and every layer are one
    torch.compile region (compiled.py), the backward one compiled graph: a micro-batch runs a few
    thousand Python calls where the eager layers ran tens of thousands (bench/host_calls.py).
    The region always gets a padding mask (all False where nothing is padded), so that a batch
    without padding runs the padded batches' graph: real micro-batches are padded
    (bench/padding.py), and a second graph would be a whole compile in the middle of a run.
    Inductor's size assertions are off in the region (dynamo's guards check the inputs' sizes
    and strides already: 880 calls a micro-batch fewer at BERT-Large's depth).
    """

    def __init__(self, config: ModelConfig, tconfig: TransformerConfig, name: str = "encoder"):
        super().__init__(config=tconfig)
        self.positional = PositionalEncoding(config, tconfig)
        self.block = TransformerBlock(tconfig, spec=encoder_layer_spec(config))
        self.region = CompiledRegion(self.encode, Graphs(f"the {name}")) \
            if config.compile_mode == "block" else None

    def forward(self, hidden: Tensor, padding) -> Tensor:
        """padding: [batch, seq] True at padded positions, or None."""
        # The block makes a view (ELECTRA's generator reads a projection) viewless with an
        # assignment to `.data`, which dynamo does not trace: a compiled block broke there and
        # then ran a graph on the wrong input. Done here, outside the region, it costs nothing.
        hidden = make_viewless_tensor(hidden, requires_grad=True, keep_graph=True)
        if self.region is None:
            return self.encode(hidden, padding)
        if padding is None:
            padding = torch.zeros(hidden.shape[1], hidden.shape[0], dtype=torch.bool,
                                  device=hidden.device)
        return self.region(hidden, padding)

    def encode(self, hidden: Tensor, padding) -> Tensor:
        n = hidden.shape[0]
        bias = self.positional.attention_bias(n, padding, hidden.dtype, hidden.device)
        return self.block(hidden, attention_mask=None, attention_bias=bias,
                          rotary_pos_emb=self.positional.rotary_embedding(n))

    def positional_scores(self, n: int) -> Tensor:
        """The content-free positional logits of every head, [heads, n, n] (the paper's Figure 6).

        Raises ValueError for encodings that have none (bert-a, nope, mask-nope, rope).
        """
        return gather_tensor_parallel(self.positional.content_free_logits(n), dim=0)


class MaskedLMHead(MegatronModule):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embedding, with its own bias.

    `hidden_size` is the encoder's width, `embedding_size` the word embedding's (they differ for
    ELECTRA's generator, which is narrower than the embedding it shares).
    """

    def __init__(self, hidden_size: int, embedding_size: int, vocab_size: int,
                 tconfig: TransformerConfig):
        super().__init__(config=tconfig)
        self.dense = nn.Linear(hidden_size, embedding_size)
        self.layer_norm = nn.LayerNorm(embedding_size, eps=tconfig.layernorm_epsilon)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            embedding_size, vocab_size, config=tconfig, init_method=tconfig.init_method,
            bias=True, skip_weight_param_allocation=True, gather_output=False)
        tconfig.init_method(self.dense.weight.data)
        self.dense.bias.data.zero_()
        self.output_layer.bias.data.zero_()

    def forward(self, hidden: Tensor, embedding_weight: Tensor) -> Tensor:
        """[n, b, hidden] -> this rank's vocabulary shard of the logits, [n, b, vocab / tp]."""
        hidden = self.layer_norm(torch.nn.functional.gelu(self.dense(hidden)))
        logits, _ = self.output_layer(hidden, weight=embedding_weight)
        return logits


def labelled_positions(labels: Tensor) -> Tensor:
    """[m] positions of the labelled tokens of labels [batch, seq], in the [seq * batch] order of
    the hidden states: the models' `labelled`. Taken where the labels are still on the
    host, it costs the accelerator no synchronisation."""
    return (labels.t().reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def at_labelled(tensor: Tensor, labelled: Tensor) -> Tensor:
    """The values of a [batch, seq] tensor at `labelled` positions: [m]."""
    return tensor.t().reshape(-1)[labelled]


def masked_lm_loss(local_logits: Tensor, labels: Tensor, denominator=None) -> Tensor:
    """Cross-entropy summed over labels != -100 and divided by `denominator` (default: their
    count, the mean); local_logits [n, b, vocab / tp], labels [n, b].

    At tensor-parallel size 1 the logits are the whole vocabulary's: torch's cross-entropy, in
    place of megatron-core's vocab-parallel one, whose autograd.Function and three all-reduces
    (over a group of one) ran every micro-batch. The same sum (tests/test_encodings.py)."""
    if denominator is None:
        denominator = (labels != IGNORE_INDEX).sum().clamp(min=1)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return whole_vocabulary_loss(local_logits, labels) / denominator
    return vocabulary_parallel_loss(local_logits, labels) / denominator


def whole_vocabulary_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The summed cross-entropy of labels != -100, in fp32; logits [..., vocab]."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def vocabulary_parallel_loss(local_logits: Tensor, labels: Tensor) -> Tensor:
    """The same sum over this rank's vocabulary shard, through megatron-core's collectives."""
    counted = labels != IGNORE_INDEX
    losses = tensor_parallel.vocab_parallel_cross_entropy(  # works in place on its input
        local_logits.to(torch.float32, copy=True), labels.masked_fill(~counted, 0))
    return torch.where(counted, losses, 0.0).sum()
