"""OUT/report.md, OUT/report.json and OUT/figures/*.png of a comparison, from what its runs left:
each run's train_log.jsonl (validation loss, seconds per step) and run.json (FLOPs per step), its
final checkpoint (exported to OUT/exports/NAME for the positional logits and for fine-tuning),
and tupe-finetune results in OUT/finetune/NAME/ when there are any.

Only reads the runs: a run still training, stopped or failed shows as such."""

import json
import os
import statistics

import numpy as np

from tupe_ds.compare import figures
from tupe_ds.compare.plan import Plan, Run
from tupe_ds.compare.runner import read_status, trained_steps
from tupe_ds.files import write_atomically
from tupe_ds.model.config import ENCODINGS

POSITIONS_SHOWN = 128  # the first positions of the positional-logit heatmaps


def read_log(run_dir: str) -> dict:
    """{step: entry} of a run's train_log.jsonl; a step logged again after a resume keeps the
    later values."""
    entries = {}
    path = os.path.join(run_dir, "train_log.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                entries.setdefault(entry["step"], {}).update(entry)
    return dict(sorted(entries.items()))


def read_description(run_dir: str):
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_record(plan: Plan, run: Run, status: dict) -> dict:
    """One run: its state and its validation curve against steps, seconds and FLOPs."""
    run_dir = plan.run_dir(run)
    entries = read_log(run_dir)
    description = read_description(run_dir)
    steps_done = trained_steps(plan, run)
    attempt = status.get(run.name)
    if steps_done >= plan.steps:
        state = "complete"
    elif attempt and attempt["exit"] != 0:
        state = f"failed (exit {attempt['exit']})"
    else:
        state = "not started" if description is None else "stopped"
    timed = [(step, e["throughput/seconds_per_step"]) for step, e in entries.items()
             if "throughput/seconds_per_step" in e]
    elapsed, previous, seconds = [], 0, 0.0
    for step, per_step in timed:  # each logged value covers the steps since the previous one
        seconds += (step - previous) * per_step
        elapsed.append(seconds)
        previous = step
    valid = {step: e for step, e in entries.items() if "valid/loss" in e}
    valid_steps = list(valid)
    flops = description["flops_per_step"] if description else 0.0
    curve = {"step": valid_steps,
             "seconds": list(np.interp(valid_steps, [s for s, _ in timed], elapsed)) if timed
             else [0.0] * len(valid_steps),
             "flops": [step * flops for step in valid_steps]}
    for name in sorted({k for e in valid.values() for k in e if k.startswith("valid/")}):
        curve[name[len("valid/"):]] = [valid[step].get(name) for step in valid_steps]
    return {"name": run.name, "encoding": run.encoding, "seed": run.seed, "state": state,
            "checkpoint_step": steps_done, "log": attempt["log"] if attempt else None,
            "training_seconds": elapsed[-1] if elapsed else None,
            "final_valid_loss": curve["loss"][-1] if valid_steps else None, "valid": curve}


def encoding_curve(records: list):
    """Mean, lowest and highest validation loss over the seeds at the steps all of them reached."""
    records = [r for r in records if r["valid"]["step"]]
    if not records:
        return None
    steps = sorted(set.intersection(*(set(r["valid"]["step"]) for r in records)))
    if not steps:
        return None
    at = [{key: dict(zip(r["valid"]["step"], r["valid"][key])) for key in ("loss", "seconds",
                                                                            "flops")}
          for r in records]
    losses = [[a["loss"][s] for a in at] for s in steps]
    return {"seeds": len(records), "step": steps,
            "mean": [statistics.fmean(v) for v in losses],
            "low": [min(v) for v in losses], "high": [max(v) for v in losses],
            "seconds": [statistics.fmean(a["seconds"][s] for a in at) for s in steps],
            "flops": [statistics.fmean(a["flops"][s] for a in at) for s in steps]}


def first_reaching(curve: dict, target: float):
    """(step, seconds) where the mean validation loss first is at or below `target`."""
    for step, loss, seconds in zip(curve["step"], curve["mean"], curve["seconds"]):
        if loss <= target:
            return step, seconds
    return None, None


def race_to_baseline(curves: dict, baseline: str) -> dict:
    """Steps (and time) each encoding takes to reach the baseline's final validation loss, and
    their share of the baseline's steps (the paper's "30% of the steps")."""
    base = curves.get(baseline)
    if base is None:
        return {"baseline": baseline, "target": None, "encodings": {}}
    target, base_step, base_seconds = base["mean"][-1], base["step"][-1], base["seconds"][-1]
    race = {}
    for encoding, curve in curves.items():
        step, seconds = first_reaching(curve, target)
        race[encoding] = {"step": step, "seconds": seconds,
                          "share_of_baseline_steps": step / base_step if step else None,
                          "share_of_baseline_time": seconds / base_seconds
                          if step and base_seconds else None}
    return {"baseline": baseline, "target": target, "baseline_step": base_step,
            "encodings": race}


def export_for(plan: Plan, run: Run) -> str:
    """OUT/exports/NAME: the run's latest checkpoint through tupe-export, redone only when the
    run has a newer checkpoint. The folder tupe-finetune --model takes."""
    from tupe_ds.export import export, find_checkpoint

    exported = os.path.join(plan.out, "exports", run.name)
    _, step_dir = find_checkpoint(plan.run_dir(run))
    config = os.path.join(exported, "config.json")
    if os.path.exists(config):
        with open(config) as f:
            if json.load(f).get("source") == step_dir:
                return exported
    export(plan.run_dir(run), exported)
    return exported


def positional_figures(plan: Plan, records: list) -> dict:
    """For each encoding with content-free positional logits: the first seed with a checkpoint,
    exported, its [heads, n, n] logits drawn to figures/positional-ENCODING.png."""
    from tupe_ds.export import load_exported

    found = {}
    for encoding in plan.encodings:
        if not ENCODINGS[encoding].has_positional_logits:
            continue
        record = next((r for r in records if r["encoding"] == encoding and r["checkpoint_step"]),
                      None)
        if record is None:
            continue
        run = Run(encoding, record["seed"])
        model, config, _ = load_exported(export_for(plan, run))
        scores = model.positional_scores(min(config.seq_length, POSITIONS_SHOWN))
        scores = scores.detach().float().cpu().numpy()
        figure = os.path.join("figures", f"positional-{encoding}.png")
        figures.positional_correlations(scores, f"{encoding} ({run.name}, step "
                                        f"{record['checkpoint_step']})",
                                        os.path.join(plan.out, figure))
        found[encoding] = {"run": run.name, "step": record["checkpoint_step"], "figure": figure,
                           "cls_row": scores[:, 0, :].tolist(),
                           "cls_column": scores[:, :, 0].tolist()}
    return found


def finetune_table(plan: Plan) -> dict:
    """{encoding: {"TASK VALID (METRIC)": mean over seeds, ..., "average": ...}} from
    OUT/finetune/NAME/results.json (tupe-finetune --out OUT/finetune/NAME)."""
    scores = {}
    for run in plan.runs:
        path = os.path.join(plan.out, "finetune", run.name, "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            tasks = json.load(f)["tasks"]
        for task, result in tasks.items():
            for valid, values in result.items():
                if valid == "best":
                    continue
                for metric, value in values.items():
                    column = f"{task} {valid} ({metric})"
                    scores.setdefault(run.encoding, {}).setdefault(column, []).append(value)
    table = {}
    for encoding, columns in scores.items():
        row = {column: statistics.fmean(values) for column, values in columns.items()}
        row["average"] = statistics.fmean(row.values())
        table[encoding] = row
    return table


def build(plan: Plan) -> dict:
    """Everything report.json holds; draws the figures on the way."""
    os.makedirs(os.path.join(plan.out, "figures"), exist_ok=True)
    status = read_status(plan.out)
    records = [run_record(plan, run, status) for run in plan.runs]
    curves = {}
    for encoding in plan.encodings:
        curve = encoding_curve([r for r in records if r["encoding"] == encoding])
        if curve:
            curves[encoding] = curve
    race = race_to_baseline(curves, plan.baseline)
    loss_figure = os.path.join("figures", "valid_loss.png")
    if curves:
        figures.loss_curves(curves, os.path.join(plan.out, loss_figure), race["target"])
    description = next((read_description(plan.run_dir(Run(r["encoding"], r["seed"])))
                        for r in records if r["state"] != "not started"), None)
    return {"encodings": list(plan.encodings), "seeds": list(plan.seeds), "steps": plan.steps,
            "baseline": plan.baseline, "data": plan.data,
            "pretrain_flags": list(plan.pretrain_flags),
            "global_batch": description["global_batch"] if description else None,
            "seq_len": description["seq_len"] if description else None,
            "runs": records, "curves": curves, "race": race,
            "figures": {"valid_loss": loss_figure if curves else None},
            "positional": positional_figures(plan, records), "finetune": finetune_table(plan)}


def hours(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def number(value, digits=4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    flags = " ".join(report["pretrain_flags"])
    lines = [f"# Positional encodings compared: {', '.join(report['encodings'])}", "",
             f"{report['steps']} steps, seeds {', '.join(map(str, report['seeds']))}, global batch "
             f"{report['global_batch']} x {report['seq_len']} tokens, data `{report['data']}`, "
             f"flags `{flags}`. Every run sees the same batches for the same seed.", "",
             "## Runs", "", "| run | state | checkpoint step | final valid loss | training time |",
             "|---|---|---:|---:|---:|"]
    for r in report["runs"]:
        lines.append(f"| {r['name']} | {r['state']} | {r['checkpoint_step']} | "
                     f"{number(r['final_valid_loss'])} | {hours(r['training_seconds'])} |")
    race = report["race"]
    lines += ["", "## Validation loss (the paper's Figure 5)", ""]
    if report["figures"]["valid_loss"]:
        lines += [f"![validation loss]({report['figures']['valid_loss']})", "",
                  "Lines: mean over seeds; bands: lowest to highest seed; dotted: the baseline's "
                  "final loss. Time: the logged seconds per step added up, each run's start-up "
                  "(first steps) included; FLOPs: Megatron's count per step.", ""]
    if race["target"] is not None:
        baseline = race["baseline"]
        lines += [f"Steps to reach {baseline}'s final validation loss ({race['target']:.4f} at "
                  f"step {race['baseline_step']}):", "",
                  "| encoding | final valid loss (mean) | lowest - highest | steps to reach "
                  f"| share of {baseline}'s steps | time to reach |",
                  "|---|---:|---:|---:|---:|---:|"]
        for encoding, curve in report["curves"].items():
            reached = race["encodings"][encoding]
            share = reached["share_of_baseline_steps"]
            lines.append(f"| {encoding} | {curve['mean'][-1]:.4f} | {curve['low'][-1]:.4f} - "
                         f"{curve['high'][-1]:.4f} | {reached['step'] or 'not reached'} | "
                         f"{'-' if share is None else f'{share:.0%}'} | "
                         f"{hours(reached['seconds'])} |")
    else:
        lines.append(f"No validation loss of the baseline {race['baseline']} yet.")
    lines += ["", "## Positional correlations (the paper's Figure 6)", ""]
    if report["positional"]:
        for encoding, found in report["positional"].items():
            lines += [f"### {encoding}", "", f"![{encoding}]({found['figure']})", ""]
    else:
        lines.append("No run with content-free positional logits has a checkpoint yet.")
    lines += ["", "## Fine-tuning (the paper's Table 1)", ""]
    table = report["finetune"]
    if table:
        columns = sorted({c for row in table.values() for c in row if c != "average"})
        lines += ["| encoding | " + " | ".join(columns) + " | average |",
                  "|---|" + "---:|" * (len(columns) + 1)]
        for encoding, row in table.items():
            lines.append(f"| {encoding} | " + " | ".join(number(row.get(c)) for c in columns)
                         + f" | {row['average']:.4f} |")
        lines += ["", "Each cell: the mean over seeds of tupe-finetune's best configuration."]
    else:
        lines.append("No fine-tuning results: run `tupe-finetune --model OUT/exports/NAME --out "
                     "OUT/finetune/NAME ...` for the runs, then the report again.")
    return "\n".join(lines) + "\n"


def write_report(plan: Plan) -> dict:
    report = build(plan)
    write_atomically(os.path.join(plan.out, "report.json"), json.dumps(report, indent=1))
    write_atomically(os.path.join(plan.out, "report.md"), markdown(report))
    return report
