"""The paper's Table 1 from a comparison's fine-tunes: each encoding's GLUE scores, and its
differences from the baseline encoding with 95% intervals.

A score is the paper's: per task, the median over fine-tuning seeds of the best learning rate
(tupe-finetune's TASK.json, `best_median`), x100; MNLI gives two columns (m, mm), and the average
is over the columns, as in the paper. Per encoding: the mean over pretraining seeds and their
standard deviation. A difference from the baseline comes with a 95% interval:
- from several pretraining seeds fine-tuned for both: paired over them (Student's t on the
  per-seed differences; a seed fixes the initialisation and data order both runs saw);
- from one: a bootstrap over the fine-tuning seeds, resampled independently per encoding and
  task, with the best learning rate chosen again in every resample as the score itself does.
  Written here with numpy: scipy.stats.bootstrap wants samples that broadcast to one shape, and
  these are [dev sets, learning rates, seeds] tables of a different shape per task.
"""

import math
import statistics

import numpy as np
import scipy.stats

from tupe_ds.finetune.tasks import TASKS

LEVEL = 0.95
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the report is the same every time it is made
NO_INTERVAL = ("no interval: one fine-tuning seed, or no pretraining seed fine-tuned for both "
               "encodings")


def columns(tasks) -> list:
    """Table 1's columns for these tasks: one per task and dev set ("mnli-m", "mnli-mm", "rte")."""
    return [column(task, name, len(TASKS[task].glue_dev))
            for task in tasks for name, _ in TASKS[task].glue_dev]


def column(task: str, dev_set: str, sets: int) -> str:
    return task if sets == 1 else f"{task}-{dev_set}"


def scores(summary: dict) -> dict:
    """{column: the paper's score x100} of one TASK.json."""
    best = summary["best_median"]
    return {column(summary["task"], name, len(best)): 100 * values[summary["metric"]]
            for name, values in best.items()}


def seed_table(summary: dict) -> np.ndarray:
    """[dev sets, learning rates, fine-tuning seeds] of the task's metric, x100."""
    configurations = list(summary["configurations"].values())
    seeds = sorted(configurations[0]["seeds"], key=int)
    return np.array([[[100 * c["seeds"][s][name][summary["metric"]] for s in seeds]
                      for c in configurations] for name in summary["best_median"]])


def resampled_scores(summary: dict, resamples: int, rng: np.random.Generator) -> dict:
    """{column: [resamples] scores} of bootstrap resamples of the fine-tuning seeds (the same
    seeds for every learning rate and dev set); the first dev set picks the learning rate."""
    table = seed_table(summary)
    picks = rng.integers(0, table.shape[-1], size=(resamples, table.shape[-1]))
    medians = np.median(table[:, :, picks], axis=-1)  # [sets, learning rates, resamples]
    chosen = medians[:, medians[0].argmax(axis=0), np.arange(resamples)]  # [sets, resamples]
    return {name: values for name, values in zip(scores(summary), chosen)}


def cell(values: dict) -> dict:
    """{pretraining seed: score} -> mean and standard deviation over the seeds."""
    found = list(values.values())
    return {"seeds": values, "mean": statistics.fmean(found) if found else None,
            "sd": statistics.stdev(found) if len(found) > 1 else None}


def interval(difference: float, low: float, high: float, method: str) -> dict:
    return {"difference": difference, "low": low, "high": high, "method": method,
            "contains_zero": bool(low <= 0 <= high)}


def paired(differences: list) -> dict:
    """Student's t interval on per-pretraining-seed differences."""
    n = len(differences)
    mean = statistics.fmean(differences)
    half = scipy.stats.t.ppf(0.5 + LEVEL / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return interval(mean, mean - half, mean + half, f"paired over {n} pretraining seeds")


def bootstrap(encoding: dict, baseline: dict, wanted: list, resamples: int) -> dict:
    """{column: interval} of encoding - baseline from one pretraining seed each ({task: TASK.json}
    for the same tasks), by resampling their fine-tuning seeds; `average` when every column of
    `wanted` is there. None for a column whose fine-tunes have fewer than 2 seeds."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    drawn = [{}, {}]
    for side, summaries in zip(drawn, (encoding, baseline)):
        for task in sorted(summaries):
            side.update(resampled_scores(summaries[task], resamples, rng))
    point = [{c: v for s in summaries.values() for c, v in scores(s).items()}
             for summaries in (encoding, baseline)]
    differences = {c: (point[0][c] - point[1][c], drawn[0][c] - drawn[1][c])
                   for c in wanted if c in point[0] and c in point[1]}
    if len(differences) == len(wanted):
        differences["average"] = tuple(np.mean([d[i] for d in differences.values()], axis=0)
                                       for i in (0, 1))
    seeds = {c: seed_table(s).shape[-1] for summaries in (encoding, baseline)
             for s in summaries.values() for c in scores(s)}
    result = {}
    for name, (difference, resampled) in differences.items():
        fewest = min(seeds[c] for c in (wanted if name == "average" else [name]))
        if fewest < 2:
            result[name] = None
            continue
        low, high = np.quantile(resampled, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        result[name] = interval(float(difference), float(low), float(high),
                                f"bootstrap over {fewest} fine-tuning seeds")
    return result


def table(finetunes: dict, baseline: str, tasks, resamples: int = RESAMPLES) -> dict:
    """finetunes: {encoding: {pretraining seed: {task: TASK.json}}} (the finished fine-tunes).
    Returns {"columns", "baseline", "scores": {encoding: {column: cell}}, "differences":
    {encoding: {column: interval or None}}}; `average` is a column."""
    wanted = columns(tasks)
    per_seed = {}
    for encoding, seeds in finetunes.items():
        for seed, summaries in seeds.items():
            found = {c: v for s in summaries.values() for c, v in scores(s).items()}
            if all(c in found for c in wanted):
                found["average"] = statistics.fmean(found[c] for c in wanted)
            per_seed.setdefault(encoding, {})[seed] = found
    everything = [*wanted, "average"]
    result = {"columns": everything, "baseline": baseline, "level": LEVEL,
              "scores": {encoding: {c: cell({s: v[c] for s, v in seeds.items() if c in v})
                                    for c in everything}
                         for encoding, seeds in per_seed.items()},
              "differences": {}}
    base = per_seed.get(baseline, {})
    for encoding, seeds in per_seed.items():
        if encoding == baseline:
            continue
        found, bootstrapped = {}, {}  # {pretraining seed: every column's bootstrap}
        for name in everything:
            common = [s for s in seeds if name in seeds[s] and name in base.get(s, {})]
            if len(common) >= 2:
                found[name] = paired([seeds[s][name] - base[s][name] for s in common])
            elif len(common) == 1:
                seed = common[0]
                if seed not in bootstrapped:
                    bootstrapped[seed] = bootstrap(finetunes[encoding][seed],
                                                   finetunes[baseline][seed], wanted, resamples)
                found[name] = bootstrapped[seed].get(name)
            else:
                found[name] = None
        result["differences"][encoding] = found
    return result


def signed(value: float) -> str:
    return f"{value:+.2f}"


def describe(found: dict) -> str:
    """'+1.02 (95% interval +0.40 to +1.64)', with the plain words when it contains 0."""
    text = (f"{signed(found['difference'])} ({LEVEL:.0%} interval {signed(found['low'])} to "
            f"{signed(found['high'])}")
    return text + ("; contains 0: no clear difference)" if found["contains_zero"] else ")")


def headline(made: dict) -> str:
    """One sentence on the GLUE average: each encoding's difference from the baseline."""
    base = made["scores"].get(made["baseline"], {}).get("average", {}).get("mean")
    parts = []
    for encoding, found in made["differences"].items():
        average, mean = found["average"], made["scores"][encoding]["average"]["mean"]
        if average is not None:
            parts.append(f"{encoding} {describe(average)}, {average['method']}")
        elif mean is not None and base is not None:
            parts.append(f"{encoding} {signed(mean - base)} ({NO_INTERVAL})")
    if not parts:
        return f"GLUE average: no difference from {made['baseline']} yet (fine-tunes missing)."
    return f"GLUE average minus {made['baseline']}'s: " + "; ".join(parts) + "."


def markdown(made: dict) -> list:
    """Table 1 (scores, then differences from the baseline) as markdown lines."""
    names = made["columns"]
    lines = ["| encoding | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for encoding, cells in made["scores"].items():
        lines.append(f"| {encoding} | " + " | ".join(score_text(cells[c]) for c in names) + " |")
    lines += ["", "Each score: the median over fine-tuning seeds of the best learning rate, x100 "
                  "(the paper's); with several pretraining seeds their mean ± standard "
                  "deviation.", ""]
    if made["differences"]:
        lines += [f"Differences from {made['baseline']} [{LEVEL:.0%} interval]:", "",
                  "| encoding | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for encoding, found in made["differences"].items():
            lines.append(f"| {encoding} | " + " | ".join(
                "-" if found[c] is None else interval_text(found[c]) for c in names) + " |")
        methods = sorted({f["method"] for found in made["differences"].values()
                          for f in found.values() if f is not None})
        lines += ["", "Intervals: " + "; ".join(methods or [NO_INTERVAL])
                  + ". An interval that contains 0 shows no clear difference; -: "
                  + NO_INTERVAL + "."]
    return lines


def interval_text(found: dict) -> str:
    """'+1.02 [+0.40, +1.64]', or '+0.10 [-0.50, +0.70] contains 0'."""
    return (f"{signed(found['difference'])} [{signed(found['low'])}, {signed(found['high'])}]"
            + (" contains 0" if found["contains_zero"] else ""))


def score_text(found: dict) -> str:
    if found["mean"] is None:
        return "-"
    spread = "" if found["sd"] is None else f" ± {found['sd']:.2f}"
    return f"{found['mean']:.2f}{spread}"
