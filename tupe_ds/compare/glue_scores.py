"""Scores of a comparison's fine-tunes as Table 1 counts them, read from tupe-finetune's
TASK.json: a score is the paper's, per task the median over fine-tuning seeds of the best learning
rate (`best_median`), x100; MNLI gives two columns (m, mm). Also the held-out score (the learning
rate chosen on half of the fine-tuning seeds, finetune.report.held_out_median) and the per-seed
values the intervals (glue_intervals.py) resample."""

import numpy as np

from tupe_ds.finetune.report import held_out_median
from tupe_ds.finetune.tasks import TASKS


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
