"""The 95% intervals of Table 1's differences from the baseline encoding (glue.py).

A difference from the baseline comes with a 95% interval, Student's t in every case:
- from several pretraining seeds fine-tuned for both: paired over them (the per-seed differences
  of the scores). It covers pretraining and fine-tuning noise. A seed fixes the data order and
  masking both runs saw; the initialisation draws from it too, but the encodings' positional
  parameters draw first, so only their word embeddings start alike;
- from one: over its fine-tuning seeds, fine-tuning noise only. The difference is of the means
  over the seeds at each encoding's chosen learning rate, not of the scores (medians): a t
  interval around a median undercovers, the median of a few values varying more than their
  mean. Paired where both encodings ran the same seeds (a fine-tuning seed fixes the order of
  the training examples for both), else Welch's. The GLUE average is taken per fine-tuning seed
  (GLUE's average of that seed's runs), so the columns of one fine-tune (MNLI's m and mm) count
  as the one measurement they are.
Their coverage is measured by simulation in tests/test_glue_table.py."""

import statistics
import warnings

import scipy.stats

from tupe_ds.compare.glue_scores import columns, glue_average, per_fine_tuning_seed

LEVEL = 0.95
PRETRAINING_SEEDS = "pretraining seeds (pretraining and fine-tuning noise)"
ONE_PRETRAINING_SEED = ("fine-tuning seeds of one pretraining seed, the mean at each "
                        "encoding's chosen learning rate (fine-tuning noise only)")


def interval(difference: float, method: str, test, *samples, **options) -> dict:
    """{difference, low, high, method, contains_zero}: the interval at LEVEL of scipy's t `test`
    of the samples."""
    with warnings.catch_warnings():
        # scipy's warning about values all alike: their interval has width 0, as it should
        warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
        low, high = (float(end) for end in test(*samples, **options).confidence_interval(LEVEL))
    return {"difference": difference, "low": low, "high": high, "method": method,
            "contains_zero": bool(low <= 0 <= high)}


def paired(differences: list, what: str) -> dict:
    """Student's t interval of the mean of per-seed differences."""
    return interval(statistics.fmean(differences), f"paired t over {len(differences)} {what}",
                    scipy.stats.ttest_1samp, differences, 0)


def welch(encoding: list, baseline: list) -> dict:
    """Welch's t interval of the difference of the means (Welch-Satterthwaite degrees of
    freedom)."""
    fewer, more = sorted((len(encoding), len(baseline)))
    seeds = f"{fewer}" if fewer == more else f"{fewer} to {more}"
    return interval(statistics.fmean(encoding) - statistics.fmean(baseline),
                    f"Welch t over {seeds} {ONE_PRETRAINING_SEED}",
                    scipy.stats.ttest_ind, encoding, baseline, equal_var=False)


def with_average(summaries: dict, tasks) -> dict:
    """{column: {fine-tuning seed: value}} of one encoding's {task: TASK.json}, and "average"
    where every column of `tasks` is there: GLUE's average per seed, over the seeds every column
    has."""
    per_seed = per_fine_tuning_seed(summaries)
    wanted = columns(tasks)
    if all(c in per_seed for c in wanted):
        common = set.intersection(*(set(per_seed[c]) for c in wanted))
        per_seed["average"] = {seed: glue_average({c: per_seed[c][seed] for c in wanted}, tasks)
                               for seed in common}
    # by seed: the order a t interval and a mean take their values in moves their last digits,
    # and a killed fine-tune, or a set, gives its seeds in another order in another process
    return {name: dict(sorted(values.items())) for name, values in per_seed.items()}


def over_fine_tuning_seeds(encoding: dict, baseline: dict, tasks) -> dict:
    """{column: interval, and "average"} of encoding - baseline from one pretraining seed each
    ({task: TASK.json} of the same tasks). None for a column (or the average) with fewer than 2
    fine-tuning seeds on either side."""
    mine, theirs = with_average(encoding, tasks), with_average(baseline, tasks)
    result = {}
    for name in (name for name in mine if name in theirs):
        if min(len(mine[name]), len(theirs[name])) < 2:
            result[name] = None
        elif mine[name].keys() == theirs[name].keys():
            result[name] = paired([mine[name][s] - theirs[name][s] for s in mine[name]],
                                  ONE_PRETRAINING_SEED)
        else:
            result[name] = welch(list(mine[name].values()), list(theirs[name].values()))
    return result
