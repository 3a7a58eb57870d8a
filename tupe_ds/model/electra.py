"""ELECTRA (Clark et al., 2020) with TUPE in both networks, as the TUPE paper's appendix C.

The generator (a narrow masked-LM) fills the masked positions with tokens sampled from its own
predictions; the discriminator tells, at every token, whether it was replaced:

    loss = generator MLM loss (masked tokens) + 50 * discriminator binary cross-entropy (all
           non-pad tokens), each term normalised by its own token count

The word embedding (and p for the BERT-A/R encodings) is one tensor shared by both networks; the
generator reads it through a projection to its width and predicts through it (tied). Each network
has its own positional module of the chosen encoding.
"""

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn
from torch.profiler import record_function

from tupe_ds.model.config import ModelConfig
from tupe_ds.model.layers import (Encoder, MaskedLMHead, at_labelled, embed, labelled_positions,
                                  masked_lm_loss, token_embedding)
from tupe_ds.distributed.parallel import (accelerator_device, ensure_model_parallel,
                                          gather_tensor_parallel, seed_tensor_parallel_rng)

DISCRIMINATOR_WEIGHT = 50.0
PAIRS = {  # --model with --objective electra: (discriminator preset, generator preset)
    "electra-base": ("electra-base-discriminator", "electra-base-generator"),
    "tiny": ("tiny", "tiny-generator"),
}


@dataclass
class ElectraOutput:
    """The two loss terms (with their gradients, normalised as the loss is) and the metrics of
    one micro-batch, as (sum, count) pairs so that micro-batches and ranks can be added up."""

    generator_loss: Tensor
    discriminator_loss: Tensor
    metrics: Dict[str, tuple]


class ElectraForPretraining(MegatronModule):
    def __init__(self, discriminator: ModelConfig, generator: ModelConfig):
        tconfig = discriminator.transformer_config()
        super().__init__(config=tconfig)
        generator_tconfig = generator.transformer_config()
        self.model_config = discriminator
        width = discriminator.hidden_size
        self.embedding = token_embedding(discriminator, tconfig)  # shared by both networks
        self.generator_projection = nn.Linear(width, generator.hidden_size)
        self.generator = Encoder(generator, generator_tconfig, "generator")
        self.generator_head = MaskedLMHead(generator.hidden_size, width, discriminator.vocab_size,
                                           generator_tconfig)
        self.discriminator = Encoder(discriminator, tconfig, "discriminator")
        self.discriminator_head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
        for linear in (self.generator_projection, self.discriminator_head[0], self.discriminator_head[2]):
            tconfig.init_method(linear.weight.data)
            linear.bias.data.zero_()
        self.to(tconfig.params_dtype)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor], labels: Tensor,
                labelled: Optional[Tensor] = None, generator_draws: Optional[Tensor] = None,
                loss_denominators: Optional[Tensor] = None):
        """input_ids (masked), attention_mask (None: no padding), labels (original ids where
        masked, else -100): [batch, seq]; labelled: labelled_positions(labels), best taken on the
        host (computed here otherwise, which waits for the device); generator_draws [batch, seq]:
        the numbers in (0, 1] at the labelled positions that the generator's samples are drawn
        from (masking.generator_draws; None: drawn from torch's generator); loss_denominators
        [2]: what the generator's and the discriminator's summed token losses are divided by
        (None: this micro-batch's counts of masked and of real tokens, the means; training
        divides by the step's global counts, train/normalization.py).

        Returns (generator loss + 50 x discriminator loss, ElectraOutput). Nothing in here waits
        for the device: the generator's head runs on the masked tokens only, as BERT's does, and
        the sample goes back by index rather than by a boolean mask."""
        if labelled is None:
            labelled = labelled_positions(labels)
        max_positions = self.model_config.max_position_embeddings
        padding = None if attention_mask is None else attention_mask == 0
        masked_labels = at_labelled(labels, labelled)  # [m]
        n_masked = labelled.new_full((), labelled.numel())  # no host-to-device copy
        real = (torch.ones(input_ids.t().shape, dtype=torch.bool, device=input_ids.device)
                if padding is None else ~padding.t())  # [n, b]
        tokens = real.sum()
        generator_denominator, discriminator_denominator = (
            (n_masked.clamp(min=1), tokens.clamp(min=1)) if loss_denominators is None
            else loss_denominators)
        with record_function("electra/generator"):
            embedded = embed(self.embedding, input_ids, max_positions)  # [n, b, width]
            hidden = self.generator(self.generator_projection(embedded), padding)
            hidden = hidden.flatten(0, 1)[labelled].unsqueeze(1)  # [m, 1, generator width]
            word_embeddings = self.embedding.word_embeddings.weight
            logits = self.generator_head(hidden, word_embeddings)  # [m, 1, vocab / tp]
            generator_loss = masked_lm_loss(logits, masked_labels.unsqueeze(1),
                                            generator_denominator)

        with record_function("electra/sample"):
            draws = (1 - torch.rand(labelled.shape, device=labelled.device)  # (0, 1]
                     if generator_draws is None else at_labelled(generator_draws, labelled))
            sampled, predicted_ids = self.sample(logits.squeeze(1), draws)  # [m] each
            shape = input_ids.t().shape  # [n, b]
            original = input_ids.t().reshape(-1).index_copy(0, labelled, masked_labels)
            corrupted = input_ids.t().reshape(-1).index_copy(0, labelled, sampled)
            replaced = (corrupted != original).view(shape)  # a sample equal to the original
            corrupted = corrupted.view(shape)  # counts as original

        with record_function("electra/discriminator"):
            embedded = embed(self.embedding, corrupted.t(), max_positions)
            hidden = self.discriminator(embedded, padding)
            scores = self.discriminator_head(hidden).squeeze(-1).float()  # [n, b]
            token_losses = F.binary_cross_entropy_with_logits(scores, replaced.float(),
                                                              reduction="none")
            discriminator_sum = torch.where(real, token_losses, 0.0).sum()
            discriminator_loss = discriminator_sum / discriminator_denominator
        loss = generator_loss + DISCRIMINATOR_WEIGHT * discriminator_loss

        with torch.no_grad(), record_function("electra/metrics"):
            predicted = (scores > 0) & real
            replaced_real = replaced & real
            metrics = {
                "generator_loss": (generator_loss.detach() * generator_denominator, n_masked),
                "discriminator_loss": (discriminator_sum.detach(), tokens),
                "generator_accuracy": ((predicted_ids == masked_labels).sum(), n_masked),
                "replaced_fraction": (replaced_real.sum(), tokens),
                "discriminator_accuracy": (((predicted == replaced) & real).sum(), tokens),
                "discriminator_precision": ((predicted & replaced_real).sum(), predicted.sum()),
                "discriminator_recall": ((predicted & replaced_real).sum(), replaced_real.sum()),
            }
        return loss, ElectraOutput(generator_loss, discriminator_loss, metrics)

    @torch.no_grad()
    def sample(self, local_logits: Tensor, draws: Tensor) -> tuple:
        """(sample at temperature 1, argmax) of the generator's logits [m, vocab / tp], without
        gradient. Inverse-CDF sampling: the token whose interval of the cumulative softmax holds
        draws[i] x its total (draws in (0, 1], so a token of probability 0 is never drawn). One
        number per masked token, which the data stream draws from the sample's coordinates
        (Gumbel-max would need one per vocabulary entry, m x 30522 for ELECTRA-Base).
        The sample is drawn on the first tensor-parallel rank and sent to the others, so that
        every rank of a tensor-parallel group corrupts the batch in the same way (a CUDA cumsum
        is not guaranteed bitwise-reproducible)."""
        logits = gather_tensor_parallel(local_logits, dim=-1).float()
        cumulative = torch.softmax(logits, dim=-1).cumsum_(-1)
        thresholds = draws.to(cumulative.dtype).unsqueeze(1) * cumulative[:, -1:]
        sample = torch.searchsorted(cumulative, thresholds).squeeze(1)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.broadcast(sample, parallel_state.get_tensor_model_parallel_src_rank(),
                           group=parallel_state.get_tensor_model_parallel_group())
        return sample, logits.argmax(-1)

    def positional_scores(self, n: int) -> Tensor:
        """The discriminator's (the network users fine-tune): see Encoder.positional_scores."""
        return self.discriminator.positional_scores(n)


def build_electra(model: Union[str, tuple] = "electra-base", **overrides) -> ElectraForPretraining:
    """ElectraForPretraining from a pair name of PAIRS (or a (discriminator, generator) pair of
    ModelConfigs); overrides (ModelConfig fields) apply to both networks."""
    if isinstance(model, str):
        if model not in PAIRS:
            raise ValueError(f"unknown ELECTRA model {model!r}; choose one of {', '.join(PAIRS)}")
        discriminator, generator = (ModelConfig.from_preset(name, **overrides) for name in PAIRS[model])
    else:
        discriminator, generator = (dataclasses.replace(c, **overrides) for c in model)
    generator = dataclasses.replace(generator, vocab_size=discriminator.vocab_size)
    ensure_model_parallel(discriminator.tensor_parallel_size)
    seed_tensor_parallel_rng(torch.initial_seed())
    return ElectraForPretraining(discriminator, generator).to(accelerator_device())
