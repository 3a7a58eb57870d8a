"""What is trained: the model a run builds, its masking, and the metrics of its outputs.

Metrics are (sum, count) pairs per micro-batch, added up over micro-batches and data-parallel
ranks before dividing, so that train and valid figures do not depend on the layout.
"""

import torch

from tupe_ds.data.masking import BERT_MASKING, ELECTRA_MASKING, IGNORE_INDEX
from tupe_ds.model import build_model
from tupe_ds.model.electra import build_electra
from tupe_ds.model.layers import at_labelled


class MaskedLM:
    """BERT: masked-LM loss and masked-token accuracy."""

    masking = BERT_MASKING

    def build(self, configs):
        return build_model(configs[0])

    def metrics(self, batch, loss, logits) -> dict:
        """logits: [m, vocab] at the batch's labelled positions, or [batch, seq, vocab]."""
        labels = batch["labels"]
        if logits.dim() == 2:
            labels = at_labelled(labels, batch["labelled"])
        counted = labels != IGNORE_INDEX
        tokens = counted.sum()
        correct = ((logits.argmax(-1) == labels) & counted).sum()
        return {"loss": (loss.detach() * tokens, tokens), "accuracy": (correct, tokens)}

    def encoders(self, model) -> dict:
        """Networks whose positional logits go to TensorBoard, by tag prefix."""
        return {"positional_logits": model}  # BertForMaskedLM or BertPipeline


class Electra:
    """ELECTRA: generator + 50 x discriminator loss; both networks' metrics."""

    masking = ELECTRA_MASKING

    def build(self, configs):
        return build_electra(configs)  # (discriminator, generator)

    def metrics(self, batch, loss, output) -> dict:
        return output.metrics

    def encoders(self, model) -> dict:
        return {"positional_logits/discriminator": model.discriminator,
                "positional_logits/generator": model.generator}


OBJECTIVES = {"mlm": MaskedLM(), "electra": Electra()}


def add(totals: dict, metrics: dict) -> None:
    """totals[name] += [sum, count] (float64 tensors)."""
    for name, (value, count) in metrics.items():
        pair = torch.stack([torch.as_tensor(value, dtype=torch.float64),
                            torch.as_tensor(count, dtype=torch.float64)])
        totals[name] = totals[name] + pair.to(totals[name].device) if name in totals else pair
