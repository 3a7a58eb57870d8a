"""Every GPU measurement in one go, on one GPU: each row written as it is measured, one JSON and
one markdown report made from them.

    source .whl/setup.sh && python3 -m bench.gpu.suite # on the H100 (../shared/gpu/wheels.sh)
    make bench-gpu-all                               # the same; without nvidia-smi: tiny plan
    python3 -m bench.gpu.suite --report-only           # the reports of the rows file alone

Parts (--parts), in this order:
1. table: bench/gpu/step_time.py's step time, our DeepSpeed step against Hugging Face's BertForMaskedLM +
   torch AMP, BERT-Large at seq 128 and 512, every encoding, padded as the training loader pads
   (real) and unpadded;
2. electra: bench/gpu/step_time.py's ELECTRA-Base against BERT-Base (both paddings);
3. attention: bench/attention.py's kernel-layout candidates (key padding, TUPE-A's columns, head
   multiples 8 and 64) at BERT-Large shapes, seq 512;
4. data_stream: bench/data_stream.py's samples/s on one core of this machine (its tiny synthetic
   corpus: the rate, not the start-up at BERT's size);
5. sweep: bench/gpu/step_time.py's ZeRO stage x micro-batch sweep of bert-a at seq 128 (real padding).
Without CUDA the tiny plan: step_time.py at its tiny width but BERT-Large's depth (24 layers, where
the operator counts per step are BERT-Large's), one step each; the other parts at tiny sizes.

Each row (a model build of step_time.py, a padding's attention candidates, the data stream's figures)
is appended to the rows file (--rows, JSON lines) and flushed to disk as soon as it is measured;
the JSON and markdown are made from that file after each part, and by --report-only from the file
alone: a run cut at any point keeps every finished row. A rows file of an earlier run is moved
aside (its name stamped with its time), never overwritten.

Before each model build and each other part, the time left of --budget-s (default 570 s,
counted from the process's start: one 10-minute device call less margin) is checked against its
estimate: the longest row of its kind (part, seq, padding) measured in this run, else GUESSES.
What does not fit is skipped with the rest of its part; the report says so and gives the command
that runs it. The estimates are guesses (GUESSES), not measurements, and are labelled so wherever
they are printed.
"""

import argparse
import functools
import json
import os
import subprocess
import tempfile
import time

import psutil
from deepspeed.accelerator import get_accelerator

from bench import attention, data_stream
from bench.gpu import step_time
from bench.gpu.markdown import table, verdict, verdict_table
from bench.gpu.measure import BUILDS
from bench.gpu.report import report as gpu_report
from bench.gpu.report import result_verdicts
from bench.gpu.runners import PADDINGS
from tupe_ds.distributed.parallel import end_distributed
from tupe_ds.tools.files import write_atomically

PARTS = ("table", "electra", "attention", "data_stream", "sweep")  # in the order they run
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = {  # the flags of each part, per device kind
    "cuda": {"gpu": ["--steps", "3", "--warmup", "1", "--sweep-zero-stages", "0,1,2",
                     "--sweep-micro-batches", "64,128", "--profiled-paddings", "real"],
             "attention": ["--steps", "10", "--warmup", "2"],
             "data_stream": ["--size", "tiny"]},
    "cpu": {"gpu": ["--layers", "24", "--seqs", "32", "--steps", "1", "--warmup", "1",
                    "--sweep-zero-stages", "0,1", "--sweep-micro-batches", "4,8"],
            "attention": ["--steps", "1", "--warmup", "1"],
            "data_stream": ["--size", "tiny", "--samples", "640", "--reference-samples", "64"]},
}
# Seconds, for the estimates: guesses, not measurements. CUDA: step times from
# ../shared/gpu/RESULTS.md (one H100, 2026-11-23, commit a01eb4b), BERT-Large at global batch 256:
# ours 667-683 samples/s at seq 128 (0.4 s a step), HF 901; tupe-r 150 at seq 512 (1.7 s);
# ELECTRA-Base 181 (1.4 s), BERT-Base about 1100 (0.25 s). Guessed, never measured: building a
# model and its engine (BERT-Large initialised on the CPU), reading a profiled step's events
# (~20,000/s in Python: 37,000 for a 24-layer tiny step took 1.7 s here; BERT-Large's 4 and 16
# micro-batches at seq 128 and 512, kernels included), the start (imports, process group, the
# first torch.compile), the attention candidates, the data stream. CPU: rough guesses for this
# plan on a 2-core CPU.
GUESSES = {
    "cuda": dict(step_s={128: 0.4, 512: 1.7}, electra_pair_step_s=1.4 + 0.25, build_s=8,
                 profile_s={128: 3, 512: 10}, start_s=45, attention_s=60, data_stream_s=30),
    "cpu": dict(step_s={32: 0.15}, electra_pair_step_s=0.06, build_s=1, profile_s={32: 2},
                start_s=10, attention_s=5, data_stream_s=10),
}
# Issue 21's targets for the data stream, samples/s on one core.
DATA_STREAM_TARGETS = {128: 20_000, 512: 6_000}


def guess_s(settings, kind: str, part: str, seq: int = None, padding: str = None) -> float:
    """GUESSES' seconds for one row of `part` (step_time.py's: its build, warm-up, timed steps and, for
    a profiled padding, the profiled steps and reading their events), or for the whole of
    attention or data_stream."""
    guess = GUESSES[kind]
    if part in ("attention", "data_stream"):
        return guess[f"{part}_s"]
    step_s = guess["electra_pair_step_s"] / 2 if part == "electra" else guess["step_s"][seq]
    profiled_steps = 2 if kind == "cuda" else 1  # the operator count (and the syncs on CUDA)
    profiled = part != "sweep" and padding in settings.profiled_paddings
    return (guess["build_s"] + (settings.warmup + settings.steps) * step_s
            + profiled * (profiled_steps * step_s + guess["profile_s"][seq]))


def estimate_s(settings, kind: str, parts=PARTS) -> dict:
    """The start's and each of `parts`' seconds by GUESSES."""
    models = 1 + len(settings.encodings) * len(settings.attention)
    seq, pairs = min(settings.seqs), 2 * bool(settings.electra_encoding)
    sweep_rows = len(settings.sweep_zero_stages) * len(settings.sweep_micro_batches)
    estimate = {
        "start": GUESSES[kind]["start_s"],
        "table": sum(models * guess_s(settings, kind, "table", length, padding)
                     for length in settings.seqs for padding in settings.padding),
        "electra": sum(pairs * guess_s(settings, kind, "electra", seq, padding)
                       for padding in settings.padding),
        "attention": guess_s(settings, kind, "attention"),
        "data_stream": guess_s(settings, kind, "data_stream"),
        "sweep": sweep_rows * guess_s(settings, kind, "sweep", seq, settings.padding[0])}
    return {part: s for part, s in estimate.items() if part == "start" or part in parts}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here)"


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
         "measured (../shared/gpu/RESULTS.md, 2026-11-23), base sizes estimated"],
        [[seq, row["samples"], f"{first[seq]['start_s']:.2f}", f"{row['start_s']:.2f}",
          f"{row['samples_per_s']:,.0f}", f"{row['reference_samples_per_s']:,.0f}",
          ", ".join(f"{name} {rate}" for name, rate in
                    data_stream.H100_RATES.get(int(seq), {}).items()) or "-"]
         for seq, row in later.items()])


class RowsFile:
    """The run's measurements as JSON lines, each flushed and fsync'd as soon as it is known: a
    run killed at any point keeps every line written before. Each line is one of
    {"run": facts}, {"part", "head"}: a part's result before its rows, {"part", "key", "row"}:
    a row of the head's list `key`, {"part", "elapsed_s"}, {"skipped": why}, {"finished": s}."""

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
    content = {"elapsed_s": {}, "skipped": []}
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
    return argparse.Namespace(**content["gpu"]["args"], cuda=content["kind"] == "cuda")


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


class Budget:
    """What is left of --budget-s since the process started, and what each kind of row (part,
    seq, padding) is expected to take: the longest measured in this run, else the guess."""

    def __init__(self, seconds: float, guess, clock=time.time, started: float = None):
        self.seconds, self.guess, self.clock = seconds, guess, clock
        self.started = psutil.Process().create_time() if started is None else started
        self.measured = {}

    def left_s(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def estimate_s(self, kind: tuple) -> float:
        return self.measured[kind] if kind in self.measured else self.guess(*kind)

    def timed(self, kind: tuple, measure):
        """measure()'s result, its time kept as `kind`'s if the longest."""
        start = self.clock()
        result = measure()
        self.measured[kind] = max(self.measured.get(kind, 0), self.clock() - start)
        return result


class Run:
    """One run: its rows file, its budget, step_time.py's settings, and the report files made from the
    rows after each part."""

    def __init__(self, paths: argparse.Namespace, budget: Budget, gpu_settings, facts: dict):
        self.paths, self.budget, self.gpu_settings = paths, budget, gpu_settings
        self.rows = RowsFile(paths.rows)
        self.rows.write(run=facts)
        for path in (paths.json, paths.markdown):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def fits(self, kind: tuple, what: str) -> bool:
        """Whether `kind`'s estimate fits in what is left; if not, the skip is recorded."""
        estimate, left = self.budget.estimate_s(kind), self.budget.left_s()
        if estimate <= left:
            return True
        part = kind[0]
        layers = f" --layers {self.paths.layers}" if self.paths.layers else ""
        why = (f"{what} ({estimate:.0f} s estimated, {max(left, 0):.0f} s of the "
               f"{self.budget.seconds:.0f} s budget left); to run {part} alone: "
               f"`python3 -m bench.gpu.suite --parts {part}{layers} "
               f"--json build/bench-gpu-all-{part}.json`")
        print(f"skipped: {why}", flush=True)
        self.rows.write(skipped=why)
        return False

    def write_rows(self, part: str, key: str, rows: list) -> None:
        for row in rows:
            self.rows.write(part=part, key=key, row=row)

    def done(self, part: str, started: float) -> None:
        self.rows.write(part=part, elapsed_s=time.perf_counter() - started)
        write_reports(self.paths)

    def measure_rows(self, part: str, builds) -> None:
        """step_time.py's `part`, one Build at a time while the next fits, each row written when
        measured."""
        started = time.perf_counter()
        for build in builds:
            kind = (part, build.seq, build.padding)
            where = f"{build.model}, {PADDINGS[build.padding]}, seq {build.seq}"
            if not self.fits(kind, f"{part} rows from {where} on"):
                break
            row = self.budget.timed(kind, lambda: build.measure(self.gpu_settings))
            self.write_rows("gpu", step_time.PARTS[part], [row])
        self.done(part, started)

    def attention(self, argv: list) -> None:
        if self.fits(("attention",), "the attention candidates"):
            started, settings = time.perf_counter(), attention.parse_args(argv)
            self.rows.write(part="attention", head=attention.head(settings))
            attention.run(settings, lambda rows: self.write_rows("attention", "rows", rows))
            self.done("attention", started)

    def data_stream(self, argv: list) -> None:
        if self.fits(("data_stream",), "the data stream"):
            started = time.perf_counter()
            self.rows.write(part="data_stream", head=data_stream_figures(argv))
            self.done("data_stream", started)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=os.path.join(ROOT, "build", "bench-gpu-all.json"))
    p.add_argument("--markdown", help="default: --json's path with .md")
    p.add_argument("--rows", help="the rows file, JSON lines (default: --json's path with "
                                  ".rows.jsonl); an earlier run's is moved aside, not replaced")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: write --json and --markdown from the rows file")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, run in this order whatever the order given: "
                        f"{', '.join(PARTS)}")
    p.add_argument("--layers", type=int,
                   help="the depth of the step-time models (default: the plan's, 24: "
                        "BERT-Large's); fewer for a quick check of the whole run")
    p.add_argument("--budget-s", type=float, default=570,
                   help="seconds since the process started: each model build and part runs only "
                        "if its estimate fits in what is left (default: a 10-minute device "
                        "call, less margin)")
    paths = p.parse_args(argv)
    base = os.path.splitext(paths.json)[0]
    paths.markdown = paths.markdown or base + ".md"
    paths.rows = paths.rows or base + ".rows.jsonl"
    parts = paths.parts.split(",")
    if set(parts) - set(PARTS):
        p.error(f"--parts: one or more of {', '.join(PARTS)}")
    paths.parts = [part for part in PARTS if part in parts]
    return paths


def main(argv=None) -> None:
    paths = parse_args(argv)
    if paths.report_only:
        write_reports(paths)
        print(f"wrote {paths.json} and {paths.markdown} from {paths.rows}")
        return
    kind = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
    plan = PLANS[kind]
    if paths.layers:
        plan = {**plan, "gpu": [*plan["gpu"], "--layers", str(paths.layers)]}
    gpu_settings = step_time.parse_args(plan["gpu"])
    estimate = estimate_s(gpu_settings, kind, paths.parts)
    parts_s = ", ".join(f"{part} {s:.0f} s" for part, s in estimate.items())
    print(f"bench/gpu/suite.py, {kind} plan: estimated {sum(estimate.values()) / 60:.1f} min, from "
          f"guessed timings: not measured ({parts_s}); budget {paths.budget_s:.0f} s; rows to "
          f"{paths.rows}", flush=True)
    budget = Budget(paths.budget_s, functools.partial(guess_s, gpu_settings, kind))
    run = Run(paths, budget, gpu_settings, dict(
        date=time.strftime("%Y-%m-%d"), commit=commit(), kind=kind, plan=plan, parts=paths.parts,
        estimate_s=estimate, budget_s=paths.budget_s))
    if set(paths.parts) & set(step_time.PARTS):
        run.rows.write(part="gpu", head=step_time.start(gpu_settings))
    for part in paths.parts:
        if part in step_time.PARTS:
            run.measure_rows(part, BUILDS[part](gpu_settings))
        elif part == "attention":
            run.attention(plan["attention"])
        else:
            run.data_stream(plan["data_stream"])
    run.rows.write(finished=time.time() - budget.started)
    write_reports(paths)
    print(f"\nwrote {paths.rows}, {paths.json} and {paths.markdown}")
    end_distributed()


if __name__ == "__main__":
    main()
