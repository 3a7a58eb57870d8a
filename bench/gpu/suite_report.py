"""bench/gpu/suite.py's rows file (JSON lines, each written as soon as it is measured) and the
JSON and markdown reports made from it, with the verdicts of what the rows hold."""

import argparse
import json
import os
import tempfile
import time

from bench import attention, data_stream
from bench.gpu.markdown import table, verdict, verdict_table
from bench.gpu.report import report as gpu_report
from bench.gpu.report import result_verdicts
from tupe_ds.tools.files import write_atomically

# Issue 21's targets for the data stream, samples/s on one core.
DATA_STREAM_TARGETS = {128: 20_000, 512: 6_000}


def data_stream_figures(argv: list) -> dict:
    """bench/data_stream.py's figures (it prints its own table)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data_stream.json")
        data_stream.main(argv + ["--json", path])
        with open(path) as f:
            return json.load(f)


def data_stream_verdicts(figures: dict) -> list:
    return [verdict("data stream samples/s on one core", row["samples_per_s"],
                    DATA_STREAM_TARGETS.get(int(seq)), False, seq=int(seq))
            for seq, row in figures["later"]["seq"].items()]


def data_stream_lines(figures: dict) -> list:
    first, later = figures["first"]["seq"], figures["later"]["seq"]
    return [f"Synthetic corpus `{figures['size']}`, one core of this machine:", ""] + table(
        ["seq", "samples", "first start s (index built)", "later start s", "samples/s",
         "per-sample reference samples/s", "what one H100 consumes, samples/s: BERT-Large "
         "measured (bench/results/h100-a01eb4b.md, 2026-11-23), base sizes estimated"],
        [[seq, row["samples"], f"{first[seq]['start_s']:.2f}", f"{row['start_s']:.2f}",
          f"{row['samples_per_s']:,.0f}", f"{row['reference_samples_per_s']:,.0f}",
          ", ".join(f"{name} {rate}" for name, rate in
                    data_stream.H100_RATES.get(int(seq), {}).items()) or "-"]
         for seq, row in later.items()])


class RowsFile:
    """The run's measurements as JSON lines, each flushed and fsync'd as soon as it is known: a
    run killed at any point keeps every line written before. Each line is one of
    {"run": facts}, {"part", "head"}: a part's result before its rows, {"part", "key", "row"}:
    a row of the head's list `key`, {"part", "elapsed_s"}, {"skipped": why}, {"failed": what,
    "error": its first lines, "at": file:line}, {"finished": s}."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            print(f"the rows of an earlier run moved to {set_aside(path)}")
        self.file = open(path, "x")

    def write(self, **line) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def set_aside(path: str) -> str:
    """Renames `path` to a free name stamped with its modification time; returns that name."""
    base, extension = os.path.splitext(path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    aside, n = f"{base}.{stamp}{extension}", 1
    while os.path.exists(aside):
        aside, n = f"{base}.{stamp}-{n}{extension}", n + 1
    os.rename(path, aside)
    return aside


def read_rows(path: str) -> list:
    """The complete lines of a rows file (a last line cut mid-write by a kill is left out)."""
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def content_of(lines: list) -> dict:
    """The report's content from the rows file's lines, with the verdicts of what they hold."""
    content = {"elapsed_s": {}, "skipped": [], "failed": []}
    for line in lines:
        if "run" in line:
            content.update(line["run"])
        elif "head" in line:
            content[line["part"]] = line["head"]
        elif "row" in line:
            content[line["part"]][line["key"]].append(line["row"])
        elif "elapsed_s" in line:
            content["elapsed_s"][line["part"]] = line["elapsed_s"]
        elif "skipped" in line:
            content["skipped"].append(line["skipped"])
        elif "failed" in line:
            content["failed"].append({key: line[key] for key in ("failed", "error", "at")})
        elif "finished" in line:
            content["finished_s"] = line["finished"]
    content["verdicts"] = []
    if "gpu" in content:
        gpu_result = content["gpu"]
        gpu_result["verdicts"] = result_verdicts(gpu_settings_of(content), gpu_result)
        content["verdicts"] += [{**v, "part": "gpu"} for v in gpu_result["verdicts"]]
    if "data_stream" in content:
        content["verdicts"] += [{**v, "part": "data_stream"}
                                for v in data_stream_verdicts(content["data_stream"])]
    return content


def gpu_settings_of(content: dict) -> argparse.Namespace:
    """step_time.py's settings as its report reads them, from the flags its result holds."""
    return argparse.Namespace(**{**content["gpu"]["args"], "cuda": content["kind"] == "cuda"})


def markdown(content: dict) -> str:
    estimate = content["estimate_s"]
    lines = [f"# bench/gpu/suite.py, {content['date']}, commit {content['commit']}", "",
             f"Estimated (guessed timings, not measured): {sum(estimate.values()) / 60:.1f} min ("
             + ", ".join(f"{part} {s:.0f} s" for part, s in estimate.items())
             + f"); budget {content['budget_s']:.0f} s.", "",
             "Measured, each part's time (s): " + (", ".join(
                 f"{part} {s:.0f}" for part, s in content["elapsed_s"].items()) or "none yet")
             + (f"; the whole run {content['finished_s']:.0f}." if "finished_s" in content else
                "; unfinished: these are the rows written so far (or before the run was cut)."),
             "", *[f"Skipped: {why}\n" for why in content["skipped"]],
             *[f"**Failed: {f['failed']}** (at `{f['at']}`; the rest ran):\n\n```\n"
               + "\n".join(f["error"]) + "\n```\n" for f in content["failed"]],
             "## All verdicts", "", *verdict_table(content["verdicts"])]
    if "gpu" in content:
        lines += ["", "## Step time, ELECTRA, ZeRO sweep (bench/gpu/step_time.py)", "",
                  gpu_report(gpu_settings_of(content), content["gpu"])]
    if "attention" in content:
        lines += ["## Attention candidates (bench/attention.py)", "",
                  attention.report(content["attention"])]
    if "data_stream" in content:
        lines += ["## Data stream (bench/data_stream.py)", "",
                  *data_stream_lines(content["data_stream"])]
    return "\n".join(lines) + "\n"


def write_reports(paths: argparse.Namespace) -> None:
    """The JSON and markdown of the rows file."""
    content = content_of(read_rows(paths.rows))
    write_atomically(paths.json, json.dumps(content, indent=1))
    write_atomically(paths.markdown, markdown(content))
