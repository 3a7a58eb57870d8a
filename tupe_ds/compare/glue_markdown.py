"""Table 1 and its headline as text: markdown lines for report.md, one sentence for the
report's summary."""

from tupe_ds.compare.glue_intervals import LEVEL

HELD_OUT = "lr held out"
INTERVAL_RULE = ("The rule: paired t over pretraining seeds where 2 or more were fine-tuned for "
                 "both encodings; else over fine-tuning seeds, a bootstrap with 5 or more a side "
                 "and Welch's t with 2 to 4 (a bootstrap of so few undercovers); coverage "
                 "measured by simulation (tests/test_glue_table.py).")
NO_INTERVAL = ("no interval: one fine-tuning seed, or no pretraining seed fine-tuned for both "
               "encodings")


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
