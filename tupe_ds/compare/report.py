"""OUT/report.md, OUT/report.json and OUT/figures/*.png of a comparison: the headline (one
sentence per result), the numbers of `results.py`, the figures of `figures.py`, the positional
logits of each run's final checkpoint (exported to OUT/exports/NAME, the folder tupe-finetune
takes) and Table 1 of the finished fine-tunes (`glue.py`, `glue_markdown.py`).

Only reads the runs: a run or fine-tune still going, stopped or failed shows as such."""

import json
import os

from tupe_ds.compare import figures, glue, glue_markdown
from tupe_ds.compare.finetuning import export_for, finetunes_of
from tupe_ds.compare.launching import read_status
from tupe_ds.compare.plan import Plan, Run
from tupe_ds.compare.results import (encoding_curve, race_to_baseline, read_description,
                                     run_record)
from tupe_ds.model.config import ENCODINGS
from tupe_ds.tools.files import write_atomically

POSITIONS_SHOWN = 128  # the first positions of the positional-logit heatmaps


def positional_figures(plan: Plan, records: list) -> dict:
    """For each encoding with content-free positional logits: the first seed with a checkpoint,
    exported, its [heads, n, n] logits drawn to figures/positional-ENCODING.png."""
    from tupe_ds.export.read import load_exported

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
    curves = {encoding: encoding_curve([r for r in records if r["encoding"] == encoding])
              for encoding in plan.encodings}
    curves = {encoding: curve for encoding, curve in curves.items() if curve}
    race = race_to_baseline(curves, plan.baseline)
    loss_figure = os.path.join("figures", "valid_loss.png")
    if curves:
        figures.loss_curves(curves, os.path.join(plan.out, loss_figure), race["target"])
    description = next((read_description(plan.run_dir(Run(r["encoding"], r["seed"])))
                        for r in records if r["state"] != "not started"), None)
    return {"encodings": list(plan.encodings), "seeds": list(plan.seeds), "steps": plan.steps,
            "baseline": plan.baseline, "data": list(plan.data),
            "pretrain_flags": list(plan.pretrain_flags),
            "recipe": {"name": plan.recipe.name, "flags": list(plan.recipe.flags),
                       "notes": list(plan.recipe.notes)},
            "global_batch": description["global_batch"] if description else None,
            "seq_len": description["seq_len"] if description else None,
            "runs": records, "curves": curves, "race": race,
            "figures": {"valid_loss": loss_figure if curves else None},
            "positional": positional_figures(plan, records), "finetune": finetune_report(plan)}


def finetune_report(plan: Plan):
    """Table 1 of the finished fine-tunes and the state of every fine-tune; None when the plan
    fine-tunes nothing."""
    if not plan.tasks:
        return None
    finetunes, states = finetunes_of(plan)
    return {"tasks": list(plan.tasks), "flags": list(plan.finetune_flags), "states": states,
            "table": glue.table(finetunes, plan.baseline, plan.tasks)}


def race_sentence(race: dict, steps: int) -> str:
    """The pretraining result in one sentence: steps to the baseline's final validation loss."""
    baseline = race["baseline"]
    if race["target"] is None:
        return f"Pretraining: no validation loss of the baseline {baseline} yet."
    parts = [f"{encoding} at step {reached['step']} ({reached['share_of_baseline_steps']:.0%} "
             "of its steps)" if reached["step"] else f"{encoding} not within {steps} steps"
             for encoding, reached in race["encodings"].items() if encoding != baseline]
    return (f"Pretraining: {baseline}'s final validation loss ({race['target']:.4f} at step "
            f"{race['baseline_step']}) was reached by " + ("; ".join(parts) or "no other encoding")
            + ".")


def headline(report: dict) -> list:
    """The comparison's results, one sentence each."""
    sentences = [race_sentence(report["race"], report["steps"])]
    if report["finetune"]:
        sentences.append(glue_markdown.headline(report["finetune"]["table"]))
    return sentences


def hours(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def recipe_lines(report: dict) -> list:
    """The recipe the runs trained under: its name, the flags it added, what it set."""
    recipe = report["recipe"]
    if recipe["name"] == "paper":
        return ["Recipe: paper (`--recipe paper`): the runs trained as the flags and --ds-config "
                "say, nothing added.", ""]
    added = " ".join(recipe["flags"]) or "nothing"
    return [f"Recipe: {recipe['name']} (`--recipe {recipe['name']}`), added to every run's "
            f"flags: `{added}`.", "", *(f"- {note}" for note in recipe["notes"]), ""]


def markdown(report: dict) -> str:
    flags = " ".join(report["pretrain_flags"])
    lines = [f"# Positional encodings compared: {', '.join(report['encodings'])}", "",
             f"{report['steps']} steps, seeds {', '.join(map(str, report['seeds']))}, global batch "
             f"{report['global_batch']} x {report['seq_len']} tokens, "
             f"data `{' '.join(report['data'])}`, "
             f"flags `{flags}`. Every run sees the same batches for the same seed.", "",
             *recipe_lines(report),
             *(line for sentence in headline(report) for line in (sentence, "")),
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
                  "final loss. Time: each run's training seconds (`time/training_seconds`: its "
                  "steps, without start-up, validation and saves); FLOPs: Megatron's count per "
                  "sample times the "
                  "samples trained (a batch ramp's smaller batches counted).", ""]
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
    lines += ["", "## GLUE (the paper's Table 1)", ""]
    finetune = report["finetune"]
    if finetune:
        states = finetune["states"]
        unfinished = [f"{name} {state}" for name, state in states.items() if state != "complete"]
        lines += [f"Fine-tuned on {', '.join(finetune['tasks'])} by tupe-finetune (flags "
                  f"`{' '.join(finetune['flags']) or 'none: the paper grid'}`): "
                  f"{len(states) - len(unfinished)} of {len(states)} fine-tunes complete"
                  + "".join(f"; {text}" for text in unfinished) + " (logs: OUT/logs/NAME.TASK.log)"
                  + ".", ""]
        lines += glue_markdown.markdown(finetune["table"])
    else:
        lines.append("Not fine-tuned: run the comparison again with --finetune GLUE_DIR "
                     "(docs/export-finetune.md, \"GLUE data\").")
    return "\n".join(lines) + "\n"


def write_report(plan: Plan) -> dict:
    report = build(plan)
    write_atomically(os.path.join(plan.out, "report.json"), json.dumps(report, indent=1))
    write_atomically(os.path.join(plan.out, "report.md"), markdown(report))
    return report
