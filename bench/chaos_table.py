"""The chaos test's account of its faults (bench/chaos.py): per kind, how many were injected,
how many fired, how many the run survived (the fault fired, the line only its reaction prints
was there, or it is silent by design, and the run reached its end), how many of those were in a
run whose end equals the uninterrupted run's bit for bit (weights, optimizer state, losses and
random state), and how many complete checkpoints were lost in the attempts they were in."""

COLUMNS = ("injected", "fired", "survived", "bit-identical", "lost")


def by_kind(report) -> dict:
    """{kind: {column: count}} of one schedule's Report."""
    rows = {}
    for fault in report.faults:
        row = rows.setdefault(fault.kind, dict.fromkeys(COLUMNS, 0))
        row["injected"] += 1
        row["lost"] += len(report.lost.get(fault.attempt, ()))
        if not fault.triggered:
            continue
        row["fired"] += 1
        survived = (fault.expect is None or bool(fault.reported)) and report.finished
        row["survived"] += survived
        row["bit-identical"] += survived and report.identical
    return rows


def added(tables) -> dict:
    """The rows of several schedules' by_kind, added up."""
    total = {}
    for rows in tables:
        for kind, row in rows.items():
            into = total.setdefault(kind, dict.fromkeys(COLUMNS, 0))
            for column in COLUMNS:
                into[column] += row[column]
    return total


def markdown(rows: dict) -> str:
    lines = ["| fault | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for kind in sorted(rows):
        lines.append(f"| {kind} | " + " | ".join(str(rows[kind][c]) for c in COLUMNS) + " |")
    lines.append("| all | " + " | ".join(str(sum(row[c] for row in rows.values()))
                                         for c in COLUMNS) + " |")
    return "\n".join(lines)
