"""tupe-finetune's reports: per task every seed and the medians (TASK.md / TASK.json), and the
best configuration of every task fine-tuned into the same folder (results.md / results.json)."""

import json
import os
import statistics

from tupe_ds.finetune.tasks import TASKS, Task
from tupe_ds.tools.files import locked, write_atomically


HELD_OUT_CHOICE = ("the learning rate chosen on half of the seeds and half of each dev set "
                   "(its examples at even positions in file order, or odd), scored on the other "
                   "seeds and the other half; the four pairings averaged")


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
    summary = {"task": task.name, "metric": task.metrics[0], "configurations": configurations,
               "best": best, "best_median": configurations[best]["median"]}
    return {**summary, "held_out_median": held_out_median(summary)}


def held_out_median(summary: dict):
    """{set: {metric: value}} of a learning-rate choice that sees none of the numbers it reports
    (`best_median` sees them all, and the best of several noisy medians wins there): the
    fine-tuning seeds, in number order, split alternately in two halves, and every dev set in
    two by its examples' positions (the runs' "halves", see run.evaluate). The configuration with
    the best median over one seed half on one dev half (the first metric on the first set) is
    scored by its median over the other seed half on the other dev half; the four pairings,
    averaged. None with fewer than 2 seeds, or from runs recorded without the halves."""
    configurations = list(summary["configurations"].values())
    seeds = sorted(configurations[0]["seeds"], key=int)
    runs = [run for c in configurations for run in c["seeds"].values()]
    if len(seeds) < 2 or not all("halves" in values for run in runs for values in run.values()):
        return None
    sets, metric = list(summary["best_median"]), summary["metric"]
    seed_halves, dev_halves = (seeds[0::2], seeds[1::2]), ("even", "odd")

    def median(configuration, seed_half, dev_half, name, m):
        return statistics.median(configuration["seeds"][s][name]["halves"][dev_half][m]
                                 for s in seed_half)

    found = {name: dict.fromkeys(values, 0.0) for name, values in summary["best_median"].items()}
    for choose_seeds, report_seeds in (seed_halves, seed_halves[::-1]):
        for choose_half, report_half in (dev_halves, dev_halves[::-1]):
            chosen = max(configurations,
                         key=lambda c: median(c, choose_seeds, choose_half, sets[0], metric))
            for name, values in found.items():
                for m in values:
                    values[m] += median(chosen, report_seeds, report_half, name, m) / 4
    return found


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
    held_out = summary.get("held_out_median")
    lines += ["", "(best): the highest median, chosen on the seeds and dev examples it reports "
                  "(the paper's protocol), which favours the score."]
    if held_out:
        lines.append(f"Held-out choice ({HELD_OUT_CHOICE}): " + ", ".join(
            f"{valid} {values[metric]:.4f}" for valid, values in held_out.items()))
    return "\n".join(lines) + "\n"


def combined_table(out: str) -> tuple:
    """(markdown, JSON) of every task summary in `out`: each task's best configuration and its
    median, the paper's way of reporting GLUE (one column per task and dev set)."""
    summaries = []
    for task in TASKS:  # GLUE's usual order
        if os.path.exists(os.path.join(out, f"{task}.json")):
            with open(os.path.join(out, f"{task}.json")) as f:
                summaries.append(json.load(f))
    columns = [(s, valid) for s in summaries for valid in s["best_median"]]
    header = " | ".join(f"{s['task']} {valid} ({s['metric']})" for s, valid in columns)

    def row(name, medians):
        values = [(medians(s) or {}).get(valid, {}).get(s["metric"]) for s, valid in columns]
        return f"| {name} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in values) + " |"

    lines = ["# Fine-tuning: best configuration per task, median over seeds", "",
             f"| learning rate chosen | {header} |", "|---|" + "---:|" * len(columns),
             row("on the seeds and dev examples reported (paper)", lambda s: s["best_median"]),
             row("held out (other seeds, other dev half)", held_out_median), "",
             "Best configurations: " + ", ".join(f"{s['task']} {s['best']}" for s in summaries),
             "", "The paper's choice picks the highest median on the same seeds and dev examples "
             f"it reports, which favours the score; held out: {HELD_OUT_CHOICE} (-: 1 seed, or "
             "runs recorded without the dev halves).",
             "", "Every seed: the TASK.md files beside this one."]
    table = {s["task"]: {"best": s["best"], **{valid: {s["metric"]: values[s["metric"]]}
                                               for valid, values in s["best_median"].items()}}
             for s in summaries}
    return "\n".join(lines) + "\n", json.dumps({"tasks": table, "summaries": summaries}, indent=1)
