"""What is trained: the model a run builds, its masking, the tokens its loss terms count, and
the metrics of its outputs.

Metrics are (sum, count) pairs per micro-batch, added up over micro-batches and data-parallel
ranks before dividing, so that train and valid figures do not depend on the layout. `loss` is
the optimised objective: each micro-batch adds (its loss, 1) x its share of the step (1 /
(micro-batches x dp), normalization.py), so a logged step's loss is exactly what DeepSpeed
differentiated, and an interval's the mean of its steps'.
"""

import torch

from tupe_ds.data.masking import BERT_MASKING, ELECTRA_MASKING, IGNORE_INDEX
from tupe_ds.model import build_model
from tupe_ds.model.electra import build_electra
from tupe_ds.model.layers import at_labelled


def masked_count(batch) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


class MaskedLM:
    """BERT: masked-LM loss and masked-token accuracy."""

    default_masking = BERT_MASKING  # --mask-rate and --mask-split change it
    generator_draws = False

    def build(self, configs):
        return build_model(configs[0])

    def token_counts(self, batch) -> list:
        """The tokens the loss is over, in a host batch: the masked ones."""
        return [masked_count(batch)]

    def forward(self, model, batch, mask, denominators):
        """(loss, logits [m, vocab]): the masked-LM head runs on the labelled tokens only."""
        return model(batch["input_ids"], mask, batch["labels"], batch["labelled"],
                     None if denominators is None else denominators[0])

    def metrics(self, batch, loss, logits, share: float) -> dict:
        """logits: [m, vocab] at the batch's labelled positions, or [batch, seq, vocab]."""
        labels = batch["labels"]
        if logits.dim() == 2:
            labels = at_labelled(labels, batch["labelled"])
        counted = labels != IGNORE_INDEX
        correct = ((logits.argmax(-1) == labels) & counted).sum()
        return {"loss": (loss.detach() * share, share), "accuracy": (correct, counted.sum())}

    def encoders(self, model) -> dict:
        """Networks whose positional logits go to TensorBoard, by tag prefix."""
        return {"positional_logits": model}  # BertForMaskedLM or BertPipeline


class Electra:
    """ELECTRA: generator + 50 x discriminator loss; both networks' metrics."""

    default_masking = ELECTRA_MASKING  # the generator's; --mask-rate and --mask-split change it
    generator_draws = True  # the stream draws the generator's samples: masking.generator_draws

    def build(self, configs):
        return build_electra(configs)  # (discriminator, generator)

    def token_counts(self, batch) -> list:
        """The generator's term is over the masked tokens, the discriminator's over the real."""
        return [masked_count(batch), int(batch["attention_mask"].sum())]

    def forward(self, model, batch, mask, denominators):
        return model(batch["input_ids"], mask, batch["labels"], batch["labelled"],
                     batch["generator_draws"], denominators)

    def metrics(self, batch, loss, output, share: float) -> dict:
        return {"loss": (loss.detach() * share, share), **output.metrics}

    def encoders(self, model) -> dict:
        return {"positional_logits/discriminator": model.discriminator,
                "positional_logits/generator": model.generator}


OBJECTIVES = {"mlm": MaskedLM(), "electra": Electra()}


def add(totals: dict, metrics: dict) -> None:
    """totals[name] += [sum, count] (float64 tensors on the device of the sum); a count given as
    a number is filled in on the device (a copy from the host would wait for it)."""
    for name, (value, count) in metrics.items():
        value = torch.as_tensor(value, dtype=torch.float64)
        count = count.to(torch.float64) if torch.is_tensor(count) else value.new_full((), count)
        pair = torch.stack([value, count])
        totals[name] = totals[name] + pair.to(totals[name].device) if name in totals else pair
