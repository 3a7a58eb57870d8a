"""Scores of a comparison's fine-tunes as Table 1 counts them, read from tupe-finetune's
TASK.json: a score is the paper's, per task the median over fine-tuning seeds of the best learning
rate (`best_median`), x100; MNLI gives two columns (m, mm). The GLUE average is GLUE's: over the
tasks, MNLI's m and mm averaged first. Also the held-out score (the learning rate chosen on other
seeds and other dev examples than it reports, finetune.report.held_out_median) and the per-seed
values the intervals (glue_intervals.py) are taken over."""

import statistics

from tupe_ds.finetune.report import held_out_median
from tupe_ds.finetune.tasks import TASKS


def task_columns(tasks) -> dict:
    """{task: its Table 1 columns, one per dev set}: {"mnli": ["mnli-m", "mnli-mm"], ...}."""
    return {task: [column(task, name, len(TASKS[task].glue_dev))
                   for name, _ in TASKS[task].glue_dev] for task in tasks}


def columns(tasks) -> list:
    """Table 1's columns for these tasks: one per task and dev set ("mnli-m", "mnli-mm", "rte")."""
    return [c for found in task_columns(tasks).values() for c in found]


def column(task: str, dev_set: str, sets: int) -> str:
    return task if sets == 1 else f"{task}-{dev_set}"


def glue_average(values: dict, tasks):
    """The mean over the tasks of each task's mean over its columns (MNLI: m and mm), as GLUE
    averages; None unless every column is in `values`. The paper's Table 1 averages the columns
    instead, which weighs MNLI twice."""
    by_task = task_columns(tasks).values()
    if not all(c in values for found in by_task for c in found):
        return None
    return statistics.fmean(statistics.fmean(values[c] for c in found) for found in by_task)


def scores(summary: dict, medians=None) -> dict:
    """{column: the paper's score x100} of one TASK.json, or of its other `medians` ({dev set:
    {metric: value}})."""
    best = summary["best_median"] if medians is None else medians
    return {column(summary["task"], name, len(best)): 100 * values[summary["metric"]]
            for name, values in best.items()}


def held_out_scores(summary: dict) -> dict:
    """{column: score x100} with the learning rate chosen on other fine-tuning seeds and other dev
    examples than it reports; none with one seed, or from runs recorded without the dev halves."""
    medians = held_out_median(summary)
    return {} if medians is None else scores(summary, medians)


def per_fine_tuning_seed(summaries: dict) -> dict:
    """{column: {fine-tuning seed: score x100 at the task's chosen learning rate}} of one side's
    {task: TASK.json}."""
    found = {}
    for s in summaries.values():
        runs = s["configurations"][s["best"]]["seeds"]
        for name in s["best_median"]:
            found[column(s["task"], name, len(s["best_median"]))] = {
                seed: 100 * values[name][s["metric"]] for seed, values in runs.items()}
    return found
