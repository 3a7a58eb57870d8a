"""The 95% intervals of Table 1's differences from the baseline encoding (glue.py).

A difference from the baseline comes with a 95% interval:
- from several pretraining seeds fine-tuned for both: paired over them (Student's t on the
  per-seed differences); it covers pretraining and fine-tuning noise. A seed fixes the data
  order and masking both runs saw; the initialisation draws from it too, but the encodings'
  positional parameters draw first, so only their word embeddings start alike;
- from one: fine-tuning noise only. With 5 or more fine-tuning seeds a side, a bootstrap over
  them, resampled independently per encoding and task, with the best learning rate chosen again
  in every resample as the score itself does. Written here with numpy: scipy.stats.bootstrap
  wants samples that broadcast to one shape, and these are [dev sets, learning rates, seeds]
  tables of a different shape per task. With 2 to 4, resampling so few values undercovers
  (2 seeds: about 70%), so the interval is Welch's t around the score difference, its width from
  the spread of the seeds at the chosen learning rates. Both are checked for coverage by
  simulation in tests/test_glue_table.py.
"""

import math
import statistics

import numpy as np
import scipy.stats

from tupe_ds.compare.glue_scores import chosen_seeds, scores, seed_counts, seed_table

LEVEL = 0.95
RESAMPLES = 10_000
BOOTSTRAP_SEEDS = 5  # fewer fine-tuning seeds a side: Welch's t (see above)
BOOTSTRAP_SEED = 0  # the report is the same every time it is made


def interval(difference: float, low: float, high: float, method: str) -> dict:
    return {"difference": difference, "low": low, "high": high, "method": method,
            "contains_zero": bool(low <= 0 <= high)}


def paired(differences: list) -> dict:
    """Student's t interval on per-pretraining-seed differences."""
    n = len(differences)
    mean = statistics.fmean(differences)
    half = scipy.stats.t.ppf(0.5 + LEVEL / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return interval(mean, mean - half, mean + half,
                    f"paired t over {n} pretraining seeds (pretraining and fine-tuning noise)")


def seeds_text(counts: list) -> str:
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low} to {high}"


def welch(difference: float, encoding: list, baseline: list, seeds: str) -> dict:
    """Welch's t interval around `difference`, the mean over columns of encoding - baseline
    scores; encoding and baseline: each column's per-seed values (x100) at the chosen learning
    rate, the columns independent (Welch-Satterthwaite degrees of freedom)."""
    parts = [[np.var(x, ddof=1) / len(x) / len(encoding) ** 2, len(x) - 1]
             for side in (encoding, baseline) for x in side]
    variance = sum(v for v, _ in parts)
    half = 0.0
    if variance > 0:
        freedom = variance ** 2 / sum(v ** 2 / f for v, f in parts)
        half = scipy.stats.t.ppf(0.5 + LEVEL / 2, freedom) * math.sqrt(variance)
    return interval(difference, difference - half, difference + half,
                    f"Welch t over {seeds} fine-tuning seeds of one pretraining seed "
                    f"(fine-tuning noise only)")


def over_fine_tuning_seeds(encoding: dict, baseline: dict, wanted: list, resamples: int) -> dict:
    """{column: interval} of encoding - baseline from one pretraining seed each ({task: TASK.json}
    for the same tasks): a bootstrap where every column has BOOTSTRAP_SEEDS seeds or more on
    both sides, else Welch's t; `average` when every column of `wanted` is there. None for a
    column whose fine-tunes have fewer than 2 seeds on either side."""
    point = [{c: v for s in summaries.values() for c, v in scores(s).items()}
             for summaries in (encoding, baseline)]
    columns = [c for c in wanted if c in point[0] and c in point[1]]
    groups = {c: [c] for c in columns}
    if len(columns) == len(wanted):
        groups["average"] = columns
    counts = [seed_counts(encoding), seed_counts(baseline)]
    result, resampled = {}, None
    for name, group in groups.items():
        seeds = [side[c] for side in counts for c in group]
        difference = float(np.mean([point[0][c] - point[1][c] for c in group]))
        if min(seeds) < 2:
            result[name] = None
        elif min(seeds) < BOOTSTRAP_SEEDS:
            chosen = [chosen_seeds(encoding), chosen_seeds(baseline)]
            result[name] = welch(difference, *([side[c] for c in group] for side in chosen),
                                 seeds_text(seeds))
        else:
            resampled = resampled or bootstrap(encoding, baseline, resamples)
            drawn = np.mean([resampled[0][c] - resampled[1][c] for c in group], axis=0)
            low, high = np.quantile(drawn, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
            result[name] = interval(difference, float(low), float(high),
                                    f"bootstrap over {seeds_text(seeds)} fine-tuning seeds of "
                                    f"one pretraining seed (fine-tuning noise only)")
    return result


def bootstrap(encoding: dict, baseline: dict, resamples: int) -> list:
    """[{column: [resamples] scores}] of each side, from one generator seeded alike every time."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    drawn = [{}, {}]
    for side, summaries in zip(drawn, (encoding, baseline)):
        for task in sorted(summaries):
            side.update(resampled_scores(summaries[task], resamples, rng))
    return drawn


def resampled_scores(summary: dict, resamples: int, rng: np.random.Generator) -> dict:
    """{column: [resamples] scores} of bootstrap resamples of the fine-tuning seeds (the same
    seeds for every learning rate and dev set); the first dev set picks the learning rate."""
    table = seed_table(summary)
    picks = rng.integers(0, table.shape[-1], size=(resamples, table.shape[-1]))
    medians = np.median(table[:, :, picks], axis=-1)  # [sets, learning rates, resamples]
    chosen = medians[:, medians[0].argmax(axis=0), np.arange(resamples)]  # [sets, resamples]
    return {name: values for name, values in zip(scores(summary), chosen)}
