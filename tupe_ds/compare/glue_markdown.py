"""Table 1 and its headline as text: markdown lines for report.md, one sentence for the
report's summary."""

from tupe_ds.compare.glue_intervals import LEVEL
from tupe_ds.finetune.report import HELD_OUT_CHOICE

HELD_OUT = "lr held out"
INTERVAL_RULE = ("The rule: paired t over pretraining seeds where 2 or more were fine-tuned for "
                 "both encodings, on the scores' differences; else over the fine-tuning seeds of "
                 "one, on the difference of their means at each encoding's chosen learning rate "
                 "(not of the medians above), paired t where both encodings ran the same seeds "
                 "and Welch's t otherwise, the average taken per fine-tuning seed (GLUE's average "
                 "of that seed's runs); coverage measured by simulation "
                 "(tests/test_glue_table.py).")
NO_INTERVAL = ("no interval: one fine-tuning seed, no pretraining seed fine-tuned for both "
               "encodings, or tasks fine-tuned with no seed in common (the average is taken per "
               "seed)")


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
    lines += ["", "Scores x100; with several pretraining seeds their mean ± standard deviation. "
                  "average: GLUE's, over the tasks, MNLI's m and mm averaged first (the paper's "
                  "Table 1 averages the columns). Each encoding's first row is the paper's "
                  "protocol: the median over fine-tuning seeds of the learning rate with the best "
                  "median, chosen on the seeds and dev examples it reports, so favoured by the "
                  f"noise of both (the best of several noisy medians wins). \"{HELD_OUT}\": "
                  f"{HELD_OUT_CHOICE}; favoured by neither, and noisier (half the seeds and half "
                  "the examples per median; -: one fine-tuning seed, or fine-tunes recorded "
                  "without the dev halves).", ""]
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
