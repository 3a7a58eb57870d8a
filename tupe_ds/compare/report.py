"""OUT/report.md, OUT/report.json and OUT/figures/*.png of a comparison: the numbers of
`results.py`, the figures of `figures.py`, and the positional logits of each run's final
checkpoint (exported to OUT/exports/NAME, also the folder tupe-finetune takes).

Only reads the runs: a run still training, stopped or failed shows as such."""

import json
import os

from tupe_ds.compare import figures
from tupe_ds.compare.plan import Plan, Run
from tupe_ds.compare.results import (encoding_curve, finetune_table, race_to_baseline,
                                     read_description, run_record)
from tupe_ds.compare.runner import read_status
from tupe_ds.files import write_atomically
from tupe_ds.model.config import ENCODINGS

POSITIONS_SHOWN = 128  # the first positions of the positional-logit heatmaps


def export_for(plan: Plan, run: Run) -> str:
    """OUT/exports/NAME: the run's latest checkpoint through tupe-export, redone only when the
    run has a newer checkpoint. The folder tupe-finetune --model takes."""
    from tupe_ds.export import export, find_checkpoint
    from tupe_ds.exported import read_export_description

    exported = os.path.join(plan.out, "exports", run.name)
    _, step_dir = find_checkpoint(plan.run_dir(run))
    if os.path.exists(os.path.join(exported, "config.json")):
        if read_export_description(exported).get("source") == step_dir:
            return exported
    export(plan.run_dir(run), exported)
    return exported


def positional_figures(plan: Plan, records: list) -> dict:
    """For each encoding with content-free positional logits: the first seed with a checkpoint,
    exported, its [heads, n, n] logits drawn to figures/positional-ENCODING.png."""
    from tupe_ds.exported import load_exported

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
