"""Validation: the objective's metrics over the first --eval-samples valid samples of each
--data source, and their blend."""

from megatron.core import parallel_state

from tupe_ds.data import sources
from tupe_ds.data.loader import valid_batches
from tupe_ds.data.prefetch import made_ahead
from tupe_ds.train.config import RunConfig
from tupe_ds.train.datasets import reads_data


def evaluate(steps, valid: list, run: RunConfig, micro_batch: int, device) -> dict:
    """The objective's metrics over the first --eval-samples valid samples of each source (the
    same ones in every layout), as valid/NAME; for a blend also each source's, as
    valid/SOURCE/NAME, and valid/NAME is their mean weighted as the blend is."""
    dp, rank = run.dp_size, parallel_state.get_data_parallel_rank()
    per_source = []
    for samples in valid:
        totals = {}
        with made_ahead(valid_batches(samples, micro_batch, rank, dp, run.eval_samples),
                        run.prefetch if reads_data(run) else 0,
                        pin=device.type != "cpu") as batches:
            steps.evaluate(batches, totals)
        per_source.append(steps.reduce(totals))
    if len(per_source) == 1:
        return {f"valid/{name}": value for name, value in per_source[0].items()}
    weights = sources.shares(run.sources)
    blended = {f"valid/{name}": sum(weight * own[name] for weight, own in zip(weights, per_source))
               for name in per_source[0]}
    for source, own in zip(run.sources, per_source):
        blended.update({f"valid/{source.name}/{name}": value for name, value in own.items()})
    return blended
