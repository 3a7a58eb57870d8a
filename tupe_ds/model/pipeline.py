"""BERT as a DeepSpeed PipelineModule (--pp > 1): what each stage holds and what it sends on.

    stage 0:    [embedding] [positional] layers ... [end of stage]
    stage s:                [positional] layers ... [end of stage]
    last stage:             [positional] layers ... [end of stage] [final LN + masked-LM head]

Two tensors travel between stages: the hidden states [n, b, h] (and their gradient on the way
back) and the attention mask [b, n] as integers (NCCL refuses bool tensors).

The positional module (p, its LayerNorm, U^Q/U^K, theta, the relative table) is one logical set
of parameters: each stage holds a tied copy (DeepSpeed's TiedLayerSpec: the copies start equal
and their gradients are all-reduced before each optimizer step) and computes the positional term
once per micro-batch for its own layers, rather than receiving v [heads, n, n] (and sending its
gradient back) from the first stage: docs/pretraining.md, "Pipeline parallelism", has the measured costs of
both (bench/pipeline.py) and the reasons. The word embedding matrix is tied between the first
stage (lookup) and the last (decoder of the masked-LM head).

Every process builds the whole BertForMaskedLM from the seed on the CPU and keeps its stage's
modules, so one seed gives the same weights whatever the pipeline (and tensor) layout.
"""

import weakref

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from torch import Tensor, nn

from tupe_ds.distributed.parallel import gather_tensor_parallel
from tupe_ds.model.bert import BertForMaskedLM
from tupe_ds.model.compiled import CompiledRegion
from tupe_ds.model.config import ModelConfig
from tupe_ds.model.layers import embed
from tupe_ds.model.pipeline_names import POSITIONAL, WORD_EMBEDDINGS


class EmbeddingPipe(nn.Module):
    """First stage: (input_ids, attention_mask) [b, n] -> (hidden [n, b, h], attention_mask)."""

    def __init__(self, model: weakref.ref):
        super().__init__()
        self.embedding = model().embedding
        self.max_positions = model().model_config.max_position_embeddings

    def forward(self, inputs):
        input_ids, attention_mask = inputs
        return embed(self.embedding, input_ids, self.max_positions), attention_mask


class PositionalPipe(nn.Module):
    """First on every stage: the positional term of the stage's layers, once per micro-batch.

    (hidden, attention_mask) -> (hidden, attention_mask, (kernel layout, rotary embedding)).
    """

    def __init__(self, model: weakref.ref):
        super().__init__()
        self.positional = model().encoder.positional

    def forward(self, inputs):
        hidden, attention_mask = inputs
        n = hidden.shape[0]
        bias = self.positional.attention_bias(n, attention_mask == 0, hidden.dtype, hidden.device)
        return hidden, attention_mask, (bias, self.positional.rotary_embedding(n))


class TransformerLayerPipe(nn.Module):
    """One megatron-core TransformerLayer, reading the positional term its stage computed. With
    compile_mode "block" each layer is a compiled region (DeepSpeed's pipeline calls the layers
    of a stage one by one): one compiled graph serves every layer of the stage, counted as the
    encoder's."""

    def __init__(self, model: weakref.ref, index: int):
        super().__init__()
        self.layer = model().encoder.block.layers[index]
        encoder = model().encoder.region  # its graphs counted as the stage's, which share them
        self.region = None if encoder is None else CompiledRegion(self.layer, encoder.graphs)

    def forward(self, inputs):
        hidden, attention_mask, positional = inputs
        bias, rotary = positional
        if not torch.is_grad_enabled():
            # DeepSpeed's pipeline marks a stage's received activations as needing gradients,
            # in evaluation too: a compiled layer would compile one more graph for them
            hidden = hidden.detach()
        hidden, _ = (self.region or self.layer)(hidden_states=hidden, attention_mask=None,
                                                attention_bias=bias, rotary_pos_emb=rotary)
        return hidden, attention_mask, positional


def end_of_stage(inputs):
    """Only tensors cross stages: the positional term stays on the stage that computed it."""
    hidden, attention_mask, _ = inputs
    return hidden, attention_mask


class MaskedLMHeadPipe(nn.Module):
    """Last stage: final LayerNorm, then the masked-LM head decoding through the word embedding
    (tied with the first stage's): -> this rank's vocabulary shard of the logits [n, b, V / tp]."""

    def __init__(self, model: weakref.ref):
        super().__init__()
        self.final_layernorm = model().encoder.block.final_layernorm
        self.lm_head = model().lm_head
        self.word_embeddings = model().embedding.word_embeddings

    def forward(self, inputs):
        hidden, _ = inputs
        return self.lm_head(self.final_layernorm(hidden), self.word_embeddings.weight)


def stage_layer_counts(config: ModelConfig, stages: int) -> list:
    """Transformer layers per stage, balancing compute with the masked-LM head on the last stage.

    The head costs V / (12 h (1 + s / 6h)) layers (the logit term of Megatron's FLOPs formula):
    about 2.5 layers for BERT-Large at s = 512, so the last stage gets fewer layers.
    """
    h, s, layers = config.hidden_size, config.seq_length, config.num_layers
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} pipeline stages need 1 to num_layers={layers} stages: "
                         "every stage holds at least one transformer layer")
    if stages == 1:
        return [layers]
    head = config.vocab_size / (12 * h * (1 + s / (6 * h)))

    def slowest(last):  # the busiest stage's cost when the last stage has `last` layers
        return max(-(-(layers - last) // (stages - 1)), last + head)

    last = min(range(layers - stages + 1, 0, -1), key=slowest)  # ties: the most on the last
    rest, extra = divmod(layers - last, stages - 1)
    return [rest + (stage < extra) for stage in range(stages - 1)] + [last]


class BertPipeline(PipelineModule):
    """BertForMaskedLM cut into pipeline stages; `loss_fn(logits, labels)` runs on the last."""

    def __init__(self, config: ModelConfig, topology: PipeModelDataParallelTopology, loss_fn):
        model = BertForMaskedLM(config)  # freed on return: each stage keeps only its modules
        ref = weakref.ref(model)
        counts = stage_layer_counts(config, topology.get_dim("pipe"))
        positional_names = [f"positional.{name}" for name, _ in
                            model.encoder.positional.named_parameters()]
        specs = [TiedLayerSpec(WORD_EMBEDDINGS, EmbeddingPipe, ref,
                               tied_weight_attr=["embedding.word_embeddings.weight"])]
        first = 0
        for count in counts:
            specs.append(TiedLayerSpec(POSITIONAL, PositionalPipe, ref,
                                       tied_weight_attr=positional_names))
            specs += [LayerSpec(TransformerLayerPipe, ref, i) for i in range(first, first + count)]
            specs.append(end_of_stage)
            first += count
        specs.append(TiedLayerSpec(WORD_EMBEDDINGS, MaskedLMHeadPipe, ref,
                                   tied_weight_attr=["word_embeddings.weight"]))
        # DeepSpeed cuts the list before each PositionalPipe: one copy at the start of each stage.
        # No autograd while it builds: it broadcasts the tied weights in place.
        with torch.no_grad():
            super().__init__(specs, topology=topology, loss_fn=loss_fn,
                             partition_method=f"type:^{PositionalPipe.__name__}$")
        self.model_config = config
        self.stage_layers = counts
        self._check_layout(counts)
        # DeepSpeed takes every parameter of a tied module on the later stages for a copy (left
        # out of the gradient norm); here only the tied attributes are copies (the last stage's
        # head is not).
        for key, comm in self.tied_comms.items():
            copy = self.global_rank != comm["ranks"][0]
            for name, param in self.tied_modules[key].named_parameters():
                param.ds_pipe_replicated = copy and name in comm["weight_attr"]

    def _check_layout(self, counts: list) -> None:
        """The stages DeepSpeed cut are the planned ones, and its process grid is megatron-core's."""
        # The embedding, then per stage its positional copy, its layers and its end_of_stage.
        starts = [1 + sum(counts[:s]) + 2 * s for s in range(len(counts))]
        if self.parts[1:-1] != starts[1:]:
            raise RuntimeError(f"DeepSpeed cut the pipeline at {self.parts}, not before each "
                               f"PositionalPipe at {starts}")
        coord = self._topo.get_coord(self.global_rank)
        ours = (parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank())
        if (coord.pipe, coord.data, coord.model) != ours:
            raise RuntimeError(f"rank {self.global_rank}: DeepSpeed's grid places it at "
                               f"(pipe, data, tensor) = {(coord.pipe, coord.data, coord.model)}, "
                               f"megatron-core at {ours}")

    def positional_scores(self, n: int) -> Tensor:
        """[heads, n, n] from this stage's copy: see Encoder.positional_scores."""
        positional = self.tied_modules["positional"].positional
        return gather_tensor_parallel(positional.content_free_logits(n), dim=0)


def pipeline_topology(pipeline: int, tensor: int, data: int) -> PipeModelDataParallelTopology:
    """Ranks ordered tensor fastest, then data, then pipeline: megatron-core's default order."""
    return PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=data)
