"""The paper's Table 1 from a comparison's fine-tunes: each encoding's GLUE scores, and its
differences from the baseline encoding with 95% intervals.

A score is the paper's: per task, the median over fine-tuning seeds of the best learning rate
(tupe-finetune's TASK.json, `best_median`), x100; MNLI gives two columns (m, mm), and the average
is over the columns, as in the paper. Choosing the learning rate on the seeds it reports favours
the score (the best of several noisy medians wins), so each encoding also gets a held-out row:
the learning rate chosen on half of the fine-tuning seeds, the score the median of the other half
(finetune.report.held_out_median). Per encoding: the mean over pretraining seeds and their
standard deviation. A difference from the baseline comes with a 95% interval:
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

from tupe_ds.finetune.report import held_out_median
from tupe_ds.finetune.tasks import TASKS

LEVEL = 0.95
RESAMPLES = 10_000
BOOTSTRAP_SEEDS = 5  # fewer fine-tuning seeds a side: Welch's t (see above)
BOOTSTRAP_SEED = 0  # the report is the same every time it is made
HELD_OUT = "lr held out"
INTERVAL_RULE = ("The rule: paired t over pretraining seeds where 2 or more were fine-tuned for "
                 "both encodings; else over fine-tuning seeds, a bootstrap with 5 or more a side "
                 "and Welch's t with 2 to 4 (a bootstrap of so few undercovers); coverage "
                 "measured by simulation (tests/test_glue_table.py).")
NO_INTERVAL = ("no interval: one fine-tuning seed, or no pretraining seed fine-tuned for both "
               "encodings")


def columns(tasks) -> list:
    """Table 1's columns for these tasks: one per task and dev set ("mnli-m", "mnli-mm", "rte")."""
    return [column(task, name, len(TASKS[task].glue_dev))
            for task in tasks for name, _ in TASKS[task].glue_dev]


def column(task: str, dev_set: str, sets: int) -> str:
    return task if sets == 1 else f"{task}-{dev_set}"


def scores(summary: dict, medians=None) -> dict:
    """{column: the paper's score x100} of one TASK.json, or of its other `medians` ({dev set:
    {metric: value}})."""
    best = summary["best_median"] if medians is None else medians
    return {column(summary["task"], name, len(best)): 100 * values[summary["metric"]]
            for name, values in best.items()}


def held_out_scores(summary: dict) -> dict:
    """{column: score x100} with the learning rate chosen on held-out fine-tuning seeds; none
    with one seed."""
    medians = held_out_median(summary)
    return {} if medians is None else scores(summary, medians)


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
    return interval(mean, mean - half, mean + half,
                    f"paired t over {n} pretraining seeds (pretraining and fine-tuning noise)")


def seed_counts(summaries: dict) -> dict:
    """{column: fine-tuning seeds} of one side's {task: TASK.json}."""
    return {c: seed_table(s).shape[-1] for s in summaries.values() for c in scores(s)}


def chosen_seeds(summaries: dict) -> dict:
    """{column: [fine-tuning seeds] x100 at the task's chosen learning rate} of one side."""
    found = {}
    for s in summaries.values():
        chosen = list(s["configurations"]).index(s["best"])
        found.update(zip(scores(s), seed_table(s)[:, chosen]))
    return found


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


def per_pretraining_seed(finetunes: dict, wanted: list, score) -> dict:
    """{encoding: {pretraining seed: {column: score(TASK.json)'s value}}}, with the average where
    every wanted column is there."""
    found = {}
    for encoding, seeds in finetunes.items():
        for seed, summaries in seeds.items():
            values = {c: v for s in summaries.values() for c, v in score(s).items()}
            if all(c in values for c in wanted):
                values["average"] = statistics.fmean(values[c] for c in wanted)
            found.setdefault(encoding, {})[seed] = values
    return found


def cells(per_seed: dict, everything: list) -> dict:
    """{encoding: {column: cell over its pretraining seeds}}."""
    return {encoding: {c: cell({s: v[c] for s, v in seeds.items() if c in v}) for c in everything}
            for encoding, seeds in per_seed.items()}


def table(finetunes: dict, baseline: str, tasks, resamples: int = RESAMPLES) -> dict:
    """finetunes: {encoding: {pretraining seed: {task: TASK.json}}} (the finished fine-tunes).
    Returns {"columns", "baseline", "level", "scores" and "held_out": {encoding: {column: cell}}
    (the paper's learning-rate choice, and the held-out one), "differences": {encoding: {column:
    interval or None}}}; `average` is a column."""
    wanted = columns(tasks)
    everything = [*wanted, "average"]
    per_seed = per_pretraining_seed(finetunes, wanted, scores)
    result = {"columns": everything, "baseline": baseline, "level": LEVEL,
              "scores": cells(per_seed, everything),
              "held_out": cells(per_pretraining_seed(finetunes, wanted, held_out_scores),
                                everything),
              "differences": {}}
    base = per_seed.get(baseline, {})
    for encoding, seeds in per_seed.items():
        if encoding == baseline:
            continue
        found, one_seed = {}, {}  # {pretraining seed: every column's interval}
        for name in everything:
            common = [s for s in seeds if name in seeds[s] and name in base.get(s, {})]
            if len(common) >= 2:
                found[name] = paired([seeds[s][name] - base[s][name] for s in common])
            elif len(common) == 1:
                seed = common[0]
                if seed not in one_seed:
                    one_seed[seed] = over_fine_tuning_seeds(
                        finetunes[encoding][seed], finetunes[baseline][seed], wanted, resamples)
                found[name] = one_seed[seed].get(name)
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
    for encoding, found in made["scores"].items():
        held_out = made["held_out"][encoding]
        lines += [f"| {encoding} | " + " | ".join(score_text(found[c]) for c in names) + " |",
                  f"| {encoding}, {HELD_OUT} | "
                  + " | ".join(score_text(held_out[c]) for c in names) + " |"]
    lines += ["", "Each score: the median over fine-tuning seeds of the best learning rate, x100 "
                  "(the paper's protocol); with several pretraining seeds their mean ± standard "
                  "deviation. The paper chooses the learning rate on the seeds it reports, which "
                  f"favours every score (the best of several noisy medians wins); \"{HELD_OUT}\" "
                  "chooses it on half of the fine-tuning seeds and scores the other half, both "
                  "ways round: not favoured by the choice, but noisier (-: one seed).", ""]
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
                  + NO_INTERVAL + ". " + INTERVAL_RULE]
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
