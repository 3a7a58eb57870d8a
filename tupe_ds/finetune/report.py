"""tupe-finetune's reports: per task every seed and the medians (TASK.md / TASK.json), and the
best configuration of every task fine-tuned into the same folder (results.md / results.json)."""

import json
import os
import statistics

from tupe_ds.files import locked, write_atomically
from tupe_ds.finetune.tasks import TASKS, Task


def write_reports(out: str, task: Task, runs: dict, settings: dict) -> dict:
    """The task's summary (returned) and the combined table of every task in `out` (under a lock:
    tupe-compare's Slurm array fine-tunes one model on several tasks at once)."""
    summary = {**summarize(task, runs), "settings": settings}
    os.makedirs(out, exist_ok=True)
    write_atomically(os.path.join(out, f"{task.name}.md"), markdown(summary))
    with locked(os.path.join(out, ".results.lock")):
        write_atomically(os.path.join(out, f"{task.name}.json"), json.dumps(summary, indent=1))
        table, everything = combined_table(out)
        write_atomically(os.path.join(out, "results.md"), table)
        write_atomically(os.path.join(out, "results.json"), everything)
    return summary


def summarize(task: Task, runs: dict) -> dict:
    """runs: {lr: {seed: {valid: {metric: value}}}} -> per configuration the seeds and medians,
    and the best configuration by the median of the task's first metric on the first set."""
    configurations = {}
    for lr, seeds in runs.items():
        valid_sets = next(iter(seeds.values()))
        median = {name: {m: statistics.median(seeds[s][name][m] for s in seeds)
                         for m in task.metrics}
                  for name in valid_sets}
        configurations[f"lr={lr:g}"] = {"lr": lr, "seeds": seeds, "median": median}
    first_set = next(iter(next(iter(configurations.values()))["median"]))
    best = max(configurations,
               key=lambda c: configurations[c]["median"][first_set][task.metrics[0]])
    return {"task": task.name, "metric": task.metrics[0], "configurations": configurations,
            "best": best, "best_median": configurations[best]["median"]}


def markdown(summary: dict) -> str:
    task, metric = summary["task"], summary["metric"]
    configurations = summary["configurations"]
    first = next(iter(configurations.values()))
    seeds = list(first["seeds"])
    sets = list(first["median"])
    lines = [f"# {task}: {metric} on the dev set(s), median of {len(seeds)} seeds", "",
             "| configuration | set | " + " | ".join(f"seed {s}" for s in seeds) + " | median |",
             "|---|---|" + "---:|" * (len(seeds) + 1)]
    for name, c in configurations.items():
        for valid in sets:
            cells = [f"{c['seeds'][s][valid][metric]:.4f}" for s in seeds]
            best = " **(best)**" if name == summary["best"] else ""
            lines.append(f"| {name}{best} | {valid} | " + " | ".join(cells)
                         + f" | {c['median'][valid][metric]:.4f} |")
    return "\n".join(lines) + "\n"


def combined_table(out: str) -> tuple:
    """(markdown, JSON) of every task summary in `out`: each task's best configuration and its
    median, the paper's way of reporting GLUE (one column per task and dev set)."""
    summaries = []
    for task in TASKS:  # GLUE's usual order
        if os.path.exists(os.path.join(out, f"{task}.json")):
            with open(os.path.join(out, f"{task}.json")) as f:
                summaries.append(json.load(f))
    columns = [(s["task"], valid, s["metric"], values[s["metric"]], s["best"])
               for s in summaries for valid, values in s["best_median"].items()]
    header = " | ".join(f"{task} {valid} ({metric})" for task, valid, metric, _, _ in columns)
    lines = ["# Fine-tuning: best configuration per task, median over seeds", "",
             f"| {header} |", "|" + "---:|" * len(columns),
             "| " + " | ".join(f"{value:.4f}" for *_, value, _ in columns) + " |", "",
             "Best configurations: "
             + ", ".join(f"{task} {best}" for task, _, _, _, best in columns),
             "", "Every seed: the TASK.md files beside this one."]
    table = {task: {"best": best, valid: {metric: value}}
             for task, valid, metric, value, best in columns}
    return "\n".join(lines) + "\n", json.dumps({"tasks": table, "summaries": summaries}, indent=1)
