"""Markdown tables and verdicts for the GPU benchmarks (bench/gpu/step_time.py, suite.py and
bench/attention.py).

A verdict is a dict: name, value, target (None: informational), at_most (the value must stay at
or below the target, else at or above), pass (None without a target), and optionally seq,
padding and detail."""


def verdict(name: str, value: float, target, at_most: bool, **where) -> dict:
    passed = None if target is None else (value <= target if at_most else value >= target)
    return {"name": name, **where, "value": value, "target": target, "at_most": at_most,
            "pass": passed}


def table(header: list, rows: list) -> list:
    """Lines of a markdown table; cells are written with str()."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def verdict_table(verdicts: list) -> list:
    rows = []
    for v in verdicts:
        target = "-" if v["target"] is None else f"{'<=' if v['at_most'] else '>='} {v['target']}"
        result = "-" if v["pass"] is None else ("PASS" if v["pass"] else "FAIL")
        rows.append([v["name"] + v.get("detail", ""), v.get("seq", "-"), v.get("padding", "-"),
                     f"{v['value']:.3f}", target, result])
    return table(["verdict", "seq", "padding", "value", "target", "result"], rows)
