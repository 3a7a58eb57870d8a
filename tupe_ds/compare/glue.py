"""The paper's Table 1 from a comparison's fine-tunes: each encoding's GLUE scores
(glue_scores.py), and its differences from the baseline encoding with 95% intervals
(glue_intervals.py); as text: glue_markdown.py.

The paper chooses the learning rate on the seeds and dev examples it reports, which favours the
score (the best of several noisy medians wins), so each encoding also gets a held-out row. Per
encoding: the mean over pretraining seeds and their standard deviation.
"""

import statistics

from tupe_ds.compare.glue_intervals import (LEVEL, PRETRAINING_SEEDS, over_fine_tuning_seeds,
                                            paired)
from tupe_ds.compare.glue_scores import columns, glue_average, held_out_scores, scores


def cell(values: dict) -> dict:
    """{pretraining seed: score} -> mean and standard deviation over the seeds."""
    found = list(values.values())
    return {"seeds": values, "mean": statistics.fmean(found) if found else None,
            "sd": statistics.stdev(found) if len(found) > 1 else None}


def per_pretraining_seed(finetunes: dict, tasks, score) -> dict:
    """{encoding: {pretraining seed: {column: score(TASK.json)'s value}}}, with the average where
    every column of `tasks` is there."""
    found = {}
    for encoding, seeds in finetunes.items():
        for seed, summaries in seeds.items():
            values = {c: v for s in summaries.values() for c, v in score(s).items()}
            average = glue_average(values, tasks)
            if average is not None:
                values["average"] = average
            found.setdefault(encoding, {})[seed] = values
    return found


def cells(per_seed: dict, everything: list) -> dict:
    """{encoding: {column: cell over its pretraining seeds}}."""
    return {encoding: {c: cell({s: v[c] for s, v in seeds.items() if c in v}) for c in everything}
            for encoding, seeds in per_seed.items()}


def table(finetunes: dict, baseline: str, tasks) -> dict:
    """finetunes: {encoding: {pretraining seed: {task: TASK.json}}} (the finished fine-tunes).
    Returns {"columns", "baseline", "level", "scores" and "held_out": {encoding: {column: cell}}
    (the paper's learning-rate choice, and the held-out one), "differences": {encoding: {column:
    interval or None}}}; `average` is a column."""
    everything = [*columns(tasks), "average"]
    per_seed = per_pretraining_seed(finetunes, tasks, scores)
    result = {"columns": everything, "baseline": baseline, "level": LEVEL,
              "scores": cells(per_seed, everything),
              "held_out": cells(per_pretraining_seed(finetunes, tasks, held_out_scores),
                                everything),
              "differences": {}}
    base = per_seed.get(baseline, {})
    for encoding, seeds in per_seed.items():
        if encoding == baseline:
            continue
        found = result["differences"][encoding] = dict.fromkeys(everything)
        for name in everything:
            common = [s for s in seeds if name in seeds[s] and name in base.get(s, {})]
            if len(common) >= 2:
                found[name] = paired([seeds[s][name] - base[s][name] for s in common],
                                     PRETRAINING_SEEDS)
            elif common:  # one pretraining seed: over its fine-tuning seeds
                seed = common[0]
                found[name] = over_fine_tuning_seeds(finetunes[encoding][seed],
                                                     finetunes[baseline][seed], tasks).get(name)
    return result
