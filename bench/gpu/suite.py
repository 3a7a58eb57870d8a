"""Every GPU measurement in one go, on one GPU: each row written as it is measured, one JSON and
one markdown report made from them.

    source .whl/setup.sh && python3 -m bench.gpu.suite # on the GPU, wheels from .whl (offline)
    make bench-gpu-all                               # the same; without nvidia-smi: tiny plan
    python3 -m bench.gpu.suite --report-only           # the reports of the rows file alone

Parts (--parts), in this order:
1. table: bench/gpu/step_time.py's step time, our DeepSpeed step against Hugging Face's BertForMaskedLM +
   torch AMP, BERT-Large at seq 128 and 512, every encoding, padded as the training loader pads
   (real; the CUDA plan leaves the unpadded rows out), HF and bert-a swept over micro-batches
   (the headline: each at its best), 2 warm-up steps, each model's first micro-batch profiled
   (operators, kernel launches, the device's busy time, host against device ms per phase);
2. electra: bench/gpu/step_time.py's ELECTRA-Base against BERT-Base (the plan's paddings);
3. attention: bench/attention.py's kernel-layout candidates (key padding, TUPE-A's columns, head
   multiples 8 and 64) at BERT-Large shapes, seq 512;
4. data_stream: bench/data_stream.py's samples/s on one core of this machine (its tiny synthetic
   corpus: the rate, not the start-up at BERT's size);
5. sweep: bench/gpu/step_time.py's ZeRO stage x micro-batch sweep of bert-a at seq 128 (real padding).
Without CUDA the tiny plan: step_time.py at its tiny width but BERT-Large's depth (24 layers, where
the operator counts per step are BERT-Large's), one step each; the other parts at tiny sizes.

Each row (step_time.py's per micro-batch, a padding's attention candidates, the data stream's
figures) is appended to the rows file (--rows, JSON lines) and flushed to disk as soon as it is
measured; the JSON and markdown are made from that file after each part, whatever happened in it,
and by --report-only from the file alone: a run cut at any point keeps every finished row. A rows
file of an earlier run is moved aside (its name stamped with its time), never overwritten.

Each part, each model build in it (its compile too) runs in a failure boundary of its own: an
exception (a compile error, a kernel the device lacks) is recorded with its first lines and where
it was raised, said in the report, and the run goes on with the next build and part; the exit
code is then 1, after the reports are written.

Before each model build and each other part, the time left of --budget-s (default 570 s,
counted from the process's start: one 10-minute device call less margin) is checked against its
estimate: the longest build of its kind (part, seq, padding, HF's or ours, micro-batches)
measured in this run, else GUESSES, whose compile times are replaced by this run's as soon as a
compiled build's first row has measured them (ELECTRA's pair compiles two graphs). What does not
fit is skipped with the rest of its part, and a build's larger micro-batches when the next one's
steps and recompile do not fit; the report says so and gives the command that runs it. The estimates are guesses (GUESSES), not
measurements, and are labelled so wherever they are printed.
"""

import argparse
import os
import subprocess
import time
import traceback

from deepspeed.accelerator import get_accelerator

from bench import attention
from bench.gpu import step_time
from bench.gpu.measure import BUILDS
from bench.gpu.runners import PADDINGS
from bench.gpu.suite_budget import Budget, Guesses, build_kind, estimate_s
from bench.gpu.suite_report import RowsFile, data_stream_figures, write_reports
from tupe_ds.distributed.parallel import end_distributed

PARTS = ("table", "electra", "attention", "data_stream", "sweep")  # in the order they run
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = {  # the flags of each part, per device kind
    "cuda": {"gpu": ["--steps", "3", "--warmup", "2", "--padding", "real",
                     "--sweep-zero-stages", "0,1,2", "--sweep-micro-batches", "64,128"],
             "attention": ["--steps", "10", "--warmup", "2"],
             "data_stream": ["--size", "tiny"]},
    "cpu": {"gpu": ["--layers", "24", "--seqs", "32", "--steps", "1", "--warmup", "2",
                    "--sweep-zero-stages", "0,1", "--sweep-micro-batches", "4,8"],
            "attention": ["--steps", "1", "--warmup", "1"],
            "data_stream": ["--size", "tiny", "--samples", "640", "--reference-samples", "64"]},
}

def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here)"


class Run:
    """One run: its rows file, its budget, step_time.py's settings, and the report files made from the
    rows after each part."""

    def __init__(self, paths: argparse.Namespace, budget: Budget, gpu_settings, facts: dict):
        self.paths, self.budget, self.gpu_settings = paths, budget, gpu_settings
        self.rows, self.failures = RowsFile(paths.rows), 0
        self.rows.write(run=facts)
        for path in (paths.json, paths.markdown):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def fits(self, kind: tuple, what: str, estimate: float = None) -> bool:
        """Whether `kind`'s estimate (or `estimate`) fits in what is left; if not, the skip is
        recorded."""
        left = self.budget.left_s()
        estimate = self.budget.estimate_s(kind) if estimate is None else estimate
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

    def next_micro_batch_fits(self, kind: tuple, where: str) -> bool:
        """Whether one more micro-batch of a build of `kind` (its steps and recompile) fits in
        what is left; if not, the skip is recorded."""
        one, two = (self.budget.guesses.seconds(*kind[:4], micros=n) for n in (1, 2))
        return self.fits(kind, f"the larger micro-batches of {where}", estimate=two - one)

    def write_rows(self, part: str, key: str, rows: list) -> None:
        for row in rows:
            self.rows.write(part=part, key=key, row=row)

    def failed(self, what: str, error: BaseException) -> None:
        """A part, a build or a compile that raised: its error's first lines and where, in the
        rows (and so the report); the run goes on with what comes next."""
        lines = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
        frames = traceback.extract_tb(error.__traceback__)
        at = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        print(f"failed: {what}: {lines[0]} (at {at}); going on", flush=True)
        self.rows.write(failed=what, error=lines[:6], at=at)
        self.failures += 1

    def done(self, part: str, started: float) -> None:
        self.rows.write(part=part, elapsed_s=time.perf_counter() - started)
        write_reports(self.paths)

    def measure_rows(self, part: str, builds) -> None:
        """step_time.py's `part`, one Build at a time while the next fits, each row written as
        it is measured and taught to the budget (its compile seconds); a build that raises is
        recorded and the next one measured."""
        for build in builds:
            kind = build_kind(part, build)
            where = f"{build.model}, {PADDINGS[build.padding]}, seq {build.seq}"
            if not self.fits(kind, f"{part} rows from {where} on"):
                break
            measured = []

            def on_row(row):
                measured.append(row)
                self.rows.write(part="gpu", key=step_time.PARTS[part], row=row)
                self.budget.guesses.learn(measured)

            try:
                self.budget.timed(kind, lambda: build.measure(
                    self.gpu_settings, on_row, lambda: self.next_micro_batch_fits(kind, where)))
            except Exception as error:  # a compile error, a kernel the device lacks, ...
                self.failed(f"{part}: {where}", error)

    def attention(self, argv: list) -> None:
        if self.fits(("attention",), "the attention candidates"):
            settings = attention.parse_args(argv)
            self.rows.write(part="attention", head=attention.head(settings))
            attention.run(settings, lambda rows: self.write_rows("attention", "rows", rows))

    def data_stream(self, argv: list) -> None:
        if self.fits(("data_stream",), "the data stream"):
            self.rows.write(part="data_stream", head=data_stream_figures(argv))

    def part(self, part: str, measure) -> None:
        """measure() in a failure boundary of its own; the reports written after it whatever
        happened."""
        started = time.perf_counter()
        try:
            measure()
        except Exception as error:
            self.failed(part, error)
        self.done(part, started)


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
        if not os.path.exists(paths.rows) or not os.path.getsize(paths.rows):
            raise SystemExit(f"--report-only: no rows in {paths.rows}; give the rows file of a "
                             "run with --rows (or its --json)")
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
    budget = Budget(paths.budget_s, Guesses(gpu_settings, kind))
    run = Run(paths, budget, gpu_settings, dict(
        date=time.strftime("%Y-%m-%d"), commit=commit(), kind=kind, plan=plan, parts=paths.parts,
        estimate_s=estimate, budget_s=paths.budget_s))
    parts = paths.parts
    if set(parts) & set(step_time.PARTS):
        try:
            run.rows.write(part="gpu", head=step_time.start(gpu_settings))
        except Exception as error:  # no process group, no device: the other parts still run
            run.failed("the start of step_time.py's parts", error)
            parts = [part for part in parts if part not in step_time.PARTS]
    for part in parts:
        if part in step_time.PARTS:
            run.part(part, lambda: run.measure_rows(part, BUILDS[part](gpu_settings)))
        elif part == "attention":
            run.part(part, lambda: run.attention(plan["attention"]))
        else:
            run.part(part, lambda: run.data_stream(plan["data_stream"]))
    run.rows.write(finished=time.time() - budget.started)
    write_reports(paths)
    print(f"\nwrote {paths.rows}, {paths.json} and {paths.markdown}"
          + (f"; {run.failures} part(s) or build(s) failed: see the report" if run.failures
             else ""))
    end_distributed()
    if run.failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
