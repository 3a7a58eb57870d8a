"""Every GPU measurement in one go, on one GPU: one JSON and one markdown report.

    source .whl/setup.sh && python3 bench/gpu_all.py # on the H100 (../shared/gpu/wheels.sh)
    make bench-gpu-all                               # the same; without nvidia-smi: tiny plan

Parts, in this order (the files are rewritten after each, so a run cut short keeps what it did):
1. bench/gpu.py: our DeepSpeed step against Hugging Face's BertForMaskedLM + torch AMP, BERT-Large
   at seq 128 and 512, every encoding, padded as the training loader pads (real) and unpadded;
2. bench/gpu.py: ELECTRA-Base against BERT-Base (both paddings);
3. bench/attention.py: every kernel-layout candidate (key padding, TUPE-A's columns, head
   multiples 8 and 64) at BERT-Large shapes, seq 512;
4. bench/data_stream.py: the data stream's samples/s on one core of this machine (its tiny
   synthetic corpus: the rate, not the start-up at BERT's size);
5. bench/gpu.py: bert-a's ZeRO stage x micro-batch sweep at seq 128 (real padding), if what is
   left of --budget-s (570 s: one 10-minute device call) holds its estimate; else the report
   says it was skipped and how to run it.
Without CUDA the tiny plan: gpu.py at its tiny width but BERT-Large's depth (24 layers, where
the operator counts per step are BERT-Large's), one step each; the other parts at tiny sizes.
An estimate of the run's time is printed first (PLANS, GUESSES).
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

from deepspeed.accelerator import get_accelerator

import attention
import data_stream
import gpu
from gpu_markdown import table, verdict, verdict_table
from gpu_measure import run_sweep
from gpu_report import report as gpu_report
from tupe_ds.files import write_atomically
from tupe_ds.parallel import end_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
# Seconds, for the estimate. CUDA: ../shared/gpu/RESULTS.md (one H100, 2026-11-23, commit
# a01eb4b), BERT-Large at global batch 256: ours 667-683 samples/s at seq 128 (0.4 s a step), HF
# 901; tupe-r 150 at seq 512 (1.7 s); ELECTRA-Base 181 (1.4 s), BERT-Base about 1100 (0.25 s).
# Not measured, guessed: building a model and its engine (BERT-Large initialised on the CPU),
# reading a profiled step's events (~20,000/s in Python: 37,000 for a 24-layer tiny step took
# 1.7 s here; BERT-Large's 4 and 16 micro-batches at seq 128 and 512, kernels included), the
# start (imports, process group, the first torch.compile), the attention candidates, the data
# stream. CPU: this plan, 2-core CPU.
GUESSES = {
    "cuda": dict(step_s={128: 0.4, 512: 1.7}, electra_pair_step_s=1.4 + 0.25, build_s=8,
                 profile_s={128: 3, 512: 10}, start_s=45, attention_s=60, data_stream_s=30),
    "cpu": dict(step_s={32: 0.15}, electra_pair_step_s=0.06, build_s=1, profile_s={32: 2},
                start_s=10, attention_s=5, data_stream_s=10),
}
# Issue 21's targets for the data stream, samples/s on one core.
DATA_STREAM_TARGETS = {128: 20_000, 512: 6_000}


def estimate_s(settings, kind: str) -> dict:
    """Each part's time from GUESSES: each row is a build and its warm-up, timed and profiled
    steps (profiled: the operator count, and on CUDA the synchronisation count)."""
    guess = GUESSES[kind]
    steps = settings.warmup + settings.steps
    profiled_steps = 2 if kind == "cuda" else 1  # the operator count (and the syncs on CUDA)

    def row_s(seq: int, padding: str, step_s: float) -> float:
        profiled = padding in settings.profiled_paddings
        return (guess["build_s"] + steps * step_s
                + profiled * (profiled_steps * step_s + guess["profile_s"][seq]))

    models = 1 + len(settings.encodings) * len(settings.attention)
    table_s = sum(models * row_s(seq, padding, guess["step_s"][seq])
                  for seq in settings.seqs for padding in settings.padding)
    seq = min(settings.seqs)
    electra_s = sum(2 * row_s(seq, padding, guess["electra_pair_step_s"] / 2)
                    for padding in settings.padding)
    sweep_rows = len(settings.sweep_zero_stages) * len(settings.sweep_micro_batches)
    sweep_s = sweep_rows * (guess["build_s"] + (settings.warmup + settings.steps)
                            * guess["step_s"][min(settings.seqs)])
    return {"start": guess["start_s"], "gpu": table_s + electra_s, "attention": guess["attention_s"],
            "data_stream": guess["data_stream_s"], "sweep": sweep_s}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here)"


def data_stream_part(argv: list) -> dict:
    """bench/data_stream.py's figures (it prints its own table) and its verdicts."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data_stream.json")
        data_stream.main(argv + ["--json", path])
        with open(path) as f:
            figures = json.load(f)
    rates = {int(seq): row["samples_per_s"] for seq, row in figures["later"]["seq"].items()}
    figures["verdicts"] = [verdict("data stream samples/s on one core", rate,
                                   DATA_STREAM_TARGETS.get(seq), False, seq=seq)
                           for seq, rate in rates.items()]
    return figures


def data_stream_lines(figures: dict) -> list:
    first, later = figures["first"]["seq"], figures["later"]["seq"]
    return [f"Synthetic corpus `{figures['size']}`, one core of this machine:", ""] + table(
        ["seq", "samples", "first start s (index built)", "later start s", "samples/s",
         "per-sample reference samples/s", "what one H100 consumes (RESULTS.md)"],
        [[seq, row["samples"], f"{first[seq]['start_s']:.2f}", f"{row['start_s']:.2f}",
          f"{row['samples_per_s']:,.0f}", f"{row['reference_samples_per_s']:,.0f}",
          ", ".join(f"{name} {rate}" for name, rate in
                    data_stream.H100_RATES.get(int(seq), {}).items()) or "-"]
         for seq, row in later.items()])


def markdown(report: dict, gpu_settings) -> str:
    lines = [f"# bench/gpu_all.py, {report['date']}, commit {report['commit']}", "",
             f"Estimated {sum(report['estimate_s'].values()) / 60:.1f} min; parts took (s): "
             + ", ".join(f"{part} {s:.0f}" for part, s in report["elapsed_s"].items()), "",
             *[f"Skipped: {why}" for why in report.get("skipped", [])], "",
             "## All verdicts", "", *verdict_table(report["verdicts"])]
    if "gpu" in report:
        lines += ["", "## Step time, ELECTRA, ZeRO sweep (bench/gpu.py)", "",
                  gpu_report(gpu_settings, report["gpu"])]
    if "attention" in report:
        lines += ["## Attention candidates (bench/attention.py)", "",
                  attention.report(report["attention"])]
    if "data_stream" in report:
        lines += ["## Data stream (bench/data_stream.py)", "",
                  *data_stream_lines(report["data_stream"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=os.path.join(ROOT, "build", "bench-gpu-all.json"))
    p.add_argument("--markdown", default=os.path.join(ROOT, "build", "bench-gpu-all.md"))
    p.add_argument("--layers", type=int,
                   help="the depth of the step-time models (default: the plan's, 24: "
                        "BERT-Large's); fewer for a quick check of the whole run")
    p.add_argument("--budget-s", type=float, default=570,
                   help="the last part (the ZeRO sweep) runs only if its estimate fits in what "
                        "is left of this (default: a 10-minute device call, less margin)")
    return p.parse_args(argv)


class ReportFiles:
    """The run's JSON and markdown, rewritten whenever a part has something new."""

    def __init__(self, paths: argparse.Namespace, gpu_settings, **content):
        self.paths, self.gpu_settings = paths, gpu_settings
        self.content = {**content, "elapsed_s": {}, "verdicts": []}
        self.started = time.perf_counter()
        for path in (paths.json, paths.markdown):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def start(self) -> None:
        self.started = time.perf_counter()

    def save(self, part: str, result: dict, verdicts: list, timed: str = None) -> None:
        """`part`'s result so far; the time since start() is `timed`'s (default: the part's)."""
        content = self.content
        content[part] = result
        content["elapsed_s"][timed or part] = time.perf_counter() - self.started
        content["verdicts"] = [v for v in content["verdicts"] if v["part"] != part] + [
            {**v, "part": part} for v in verdicts]
        write_atomically(self.paths.json, json.dumps(content, indent=1))
        write_atomically(self.paths.markdown, markdown(content, self.gpu_settings))


def main(argv=None) -> None:
    paths = parse_args(argv)
    begun = time.perf_counter()
    kind = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
    plan = PLANS[kind]
    if paths.layers:
        plan = {**plan, "gpu": [*plan["gpu"], "--layers", str(paths.layers)]}
    gpu_settings = gpu.parse_args(plan["gpu"])
    estimate = estimate_s(gpu_settings, kind)
    print(f"bench/gpu_all.py, {kind} plan: estimated {sum(estimate.values()) / 60:.1f} min "
          f"({', '.join(f'{part} {s:.0f} s' for part, s in estimate.items())})", flush=True)
    files = ReportFiles(paths, gpu_settings, date=time.strftime("%Y-%m-%d"), commit=commit(),
                        plan=plan, estimate_s=estimate, skipped=[])
    save_gpu = lambda result: files.save("gpu", result, result["verdicts"])  # noqa: E731
    gpu_result = gpu.run(gpu_settings, save_gpu, parts=("table", "electra"))
    files.start()
    files.save("attention", attention.run(attention.parse_args(plan["attention"])), [])
    files.start()
    figures = data_stream_part(plan["data_stream"])
    files.save("data_stream", figures, figures["verdicts"])
    left = paths.budget_s - (time.perf_counter() - begun)
    if left >= estimate["sweep"]:  # last: the part a run cut short can best do without
        files.start()
        gpu_result["sweep"] = run_sweep(gpu_settings)
        files.save("gpu", gpu_result, gpu_result["verdicts"], timed="sweep")
    else:
        files.content["skipped"].append(
            f"the ZeRO sweep ({estimate['sweep']:.0f} s estimated, {max(left, 0):.0f} s of the "
            f"{paths.budget_s:.0f} s budget left): run bench/gpu.py --sweep-zero-stages 0,1,2")
        files.save("gpu", gpu_result, gpu_result["verdicts"], timed="sweep")
    print(f"\nwrote {paths.json} and {paths.markdown}")
    end_distributed()


if __name__ == "__main__":
    main()
