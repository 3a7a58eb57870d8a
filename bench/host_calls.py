"""Host work per micro-batch: our training step's Python calls and host ms against Hugging Face's,
phase by phase (forward, backward, the boundary), in one run.

    DS_ACCELERATOR=cpu .venv/bin/python bench/host_calls.py     # BERT-Large's depth at a tiny width
    python3 bench/host_calls.py                                   # CUDA: BERT-Large, + device ms

Rows (--rows, in this order): `hf`, transformers' BertForMaskedLM (sdpa, torch AdamW, gradient
clipping: bench/gpu/runners.HFRunner, the step a Hugging Face user writes); `ENCODING/COMPILE`,
our model with ModelConfig.compile=COMPILE (block: the encoder one compiled region;
elementwise: the bias-dropout-add and bias-GELU regions; none: eager) through
deepspeed.initialize with the shipped BERT-Large config (ZeRO-1, DeepSpeed's timer off), the
step tupe_ds.pretrain runs (bench/gpu/runners.OursRunner); `ENCODING/COMPILE+cpp`, the same
compiled with inductor's C++ wrapper (`cpp_wrapper`, which runs the compiled graphs' runtime from
C++; tupe_ds does not set it). One model at a time, each in a failure boundary of its own (a
row that raises is said with its first lines and the rest run; exit code 1 then), --json
rewritten after each row, the same
--accumulation micro-batches of --micro-batch samples for all, padded as the training loader
pads (bench/real_lengths.py).

Per row, after --warmup steps (the first compiles: its seconds are printed): Python calls of one
step per phase (bench/gpu/phases.py: sys.setprofile's 'call' and 'c_call' events, as cProfile
counts them; deterministic, so their ratio is the figure) and the Python frames among them
('call' only: without the builtins a compiled graph's runtime calls per buffer and saved
tensor), host ms per phase (median of --steps; on a CPU the host is the
device, so they include the arithmetic, small at this width), and the ratios ours / HF per
micro-batch (forward + backward away from the boundary) and per step. On CUDA also device ms per
phase (CUDA events at the same marks: where the host ms are longer, the GPU waits for the host),
and from one profiled step the kernel launches and the GPU's busy fraction (the union of kernel
intervals over the step's span). Python calls are counted in the calling thread only before
Python 3.12 (on CUDA the autograd engine runs backward hooks in a thread of its own: there they
are undercounted).

Target (issue 55): calls per micro-batch at or below HF's for every encoding (PASS/FAIL,
informational: the exit code is 0 either way).
"""

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: bench.* from the repository's root

import tupe_ds.tools.third_party_warnings  # noqa: F401,E402  (first: filters import warnings)
import torch  # noqa: E402
import torch._inductor.config  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from bench.gpu.counts import count_ops  # noqa: E402
from bench.gpu.markdown import table  # noqa: E402
from bench.gpu.measure import free, init_distributed, machine_name, timed_step  # noqa: E402
from bench.gpu.phases import count_calls, time_phases  # noqa: E402
from bench.gpu.runners import (PADDINGS, HFRunner, OursRunner, ds_config,  # noqa: E402
                               fused_adamw_supported, make_batches)
from tupe_ds.distributed.parallel import end_distributed  # noqa: E402
from tupe_ds.model.config import COMPILE, DTYPES, ENCODINGS  # noqa: E402
from tupe_ds.tools.files import write_atomically  # noqa: E402

HF = "hf"
CPP = "+cpp"  # ENCODING/COMPILE+cpp: compiled with inductor's C++ wrapper (cpp_wrapper)
ROWS = ("hf,bert-a/block,bert-a/block+cpp,tupe-a/block,tupe-r/block,bert-r/block,bert-a/none,"
        "bert-a/elementwise")
SIZES = {  # BERT-Large's depth; on a CPU a tiny width, where the host's share is largest
    "cuda": dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=32768, seq=128, micro=64,
                 dtype="fp16"),
    "cpu": dict(layers=24, hidden=64, heads=4, ffn=128, vocab=512, seq=32, micro=4,
                dtype="fp32"),
}
COLUMNS = ("forward", "backward", "boundary", "micro_batch", "step")
TARGET = 1.0  # ours / HF's calls per micro-batch, at most


def parse_args(argv=None) -> argparse.Namespace:
    kind = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
    size = SIZES[kind]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=ROWS,
                   help="comma-separated: hf, ENCODING/COMPILE (COMPILE one of "
                        f"{', '.join(COMPILE)}), ENCODING/COMPILE{CPP} (inductor's C++ "
                        "wrapper)")
    for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
        p.add_argument(f"--{name}", type=int, default=size[name])
    p.add_argument("--micro-batch", type=int, default=size["micro"])
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--padding", choices=list(PADDINGS), default="real")
    p.add_argument("--dtype", choices=list(DTYPES), default=size["dtype"])
    p.add_argument("--ds-config", default="ds_configs/bert_large_fp16.json")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--steps", type=int, default=5, help="timed steps for host (and device) ms")
    p.add_argument("--threads", type=int, default=1 if kind == "cpu" else None,
                   help="torch threads (default on a CPU: 1, the host's own work; OpenMP "
                        "threads that wait for a busy core make ms swing on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    settings = p.parse_args(argv)
    settings.rows = [row for row in settings.rows.split(",") if row]
    if not settings.rows:
        p.error(f"--rows: name at least one: {HF}, ENCODING/COMPILE")
    for row in settings.rows:
        encoding, _, compile_mode = row.removesuffix(CPP).partition("/")
        if row != HF and (encoding not in ENCODINGS or compile_mode not in COMPILE):
            p.error(f"--rows: {row!r} is neither {HF} nor ENCODING/COMPILE[{CPP}] (ENCODING one "
                    f"of {', '.join(ENCODINGS)}; COMPILE one of {', '.join(COMPILE)})")
    if settings.warmup < 1:
        p.error("--warmup: at least 1 (the first step compiles)")
    if settings.steps < 1:
        p.error("--steps: at least 1")
    if settings.accumulation < 2 or settings.micro_batch < 1:
        p.error("--accumulation: at least 2 (a micro-batch away from the optimizer step is the "
                "figure), --micro-batch at least 1")
    # the fields bench/gpu/runners.py reads
    settings.seqs = [settings.seq]
    settings.global_batch = settings.micro_batch * settings.accumulation
    return settings


def start(settings) -> None:
    accelerator = get_accelerator()
    accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    settings.device = torch.device(accelerator.current_device_name())
    settings.cuda = settings.device.type == "cuda"
    init_distributed(settings.cuda)
    settings.fused_adamw = fused_adamw_supported(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)


def make_runner(settings, row: str, batches: list):
    config = ds_config(settings, settings.micro_batch)
    if row == HF:
        return HFRunner(settings, settings.seq, batches, config)
    encoding, compile_mode = row.removesuffix(CPP).split("/")
    return OursRunner(settings, settings.seq, batches, encoding, "fast", config, compile_mode)


def measure(settings, row: str, batches: list) -> dict:
    """One row: built, warmed up (the first step timed: compiles included), its calls per phase,
    its host (and device) ms per phase, on CUDA its launches and busy fraction. A +cpp row
    compiles (and so runs) with inductor's C++ wrapper."""
    with torch._inductor.config.patch(cpp_wrapper=row.endswith(CPP)):
        return measured(settings, row, batches)


def measured(settings, row: str, batches: list) -> dict:
    synchronize = get_accelerator().synchronize
    runner = make_runner(settings, row, batches)
    first_step_s = timed_step(runner.step)
    for _ in range(settings.warmup - 1):
        runner.step()
    result = {"row": row, "compile": getattr(runner, "compile", "-"),
              "first_step_s": first_step_s, **count_calls(runner),
              **time_phases(runner, settings.steps, settings.cuda, synchronize)}
    if settings.cuda:
        counted = count_ops(runner.step, True, synchronize)
        result.update({key: counted[key] for key in (
            "launches", "device_busy_ms", "device_span_ms", "device_busy_fraction")})
    free(runner, row)
    print(f"  {row:<22} first step {first_step_s:6.1f} s, calls per step "
          f"{result['calls']['step']:8.0f}, host ms per step {result['host_ms']['step']:8.1f}",
          flush=True)
    return result


def ratios(results: list) -> list:
    """Each of our rows' calls and host ms over HF's, per micro-batch and per step."""
    hf = next((r for r in results if r["row"] == HF), None)
    if hf is None:
        return []
    return [{"row": r["row"], **{f"{figure}_{column}": r[figure][column] / hf[figure][column]
                                 for figure in ("calls", "python_frames", "host_ms")
                                 for column in ("micro_batch", "step")}}
            for r in results if r["row"] != HF]


def cell(figures: dict, column: str, digits: int) -> str:
    return f"{figures[column]:,.{digits}f}" if column in figures else "-"


def report(settings, results: list, ratio_rows: list) -> str:
    figures = [("calls", 0), ("python_frames", 0), ("host_ms", 1)] + (
        [("device_ms", 1)] if settings.cuda else [])
    header = ["row", "compile", "first step s"] + [
        f"{figure.replace('_', ' ')}: {column.replace('_', '-')}" for figure, _ in figures
        for column in COLUMNS] + (["launches", "device busy"] if settings.cuda else [])
    lines = [[r["row"], r["compile"], f"{r['first_step_s']:.1f}"] + [
        cell(r[figure], column, digits) for figure, digits in figures for column in COLUMNS]
        + ([r["launches"], f"{r['device_busy_fraction']:.2f}"] if settings.cuda else [])
        for r in results]
    out = [f"- machine: {settings.machine}", f"- size: {settings.layers} layers, hidden "
           f"{settings.hidden}, {settings.heads} heads, FFN {settings.ffn}, vocab "
           f"{settings.vocab}, seq {settings.seq}, {settings.accumulation} micro-batches of "
           f"{settings.micro_batch} ({settings.padding} padding), {settings.dtype}; ours: "
           f"{settings.ds_config} (ZeRO-1, timer off)",
           f"- per phase: calls of one step; ms the median of {settings.steps} steps after "
           f"{settings.warmup} warm-up; per micro-batch: forward and backward are means over "
           "the step's micro-batches (backward: all but the last), micro-batch = forward + "
           "backward, the boundary is the last backward with the optimizer step", ""]
    out += table(header, lines)
    if ratio_rows:
        out += ["", "Ours / HF's (calls: deterministic; ms: this machine's noise included):", ""]
        out += table(["row", "calls per micro-batch", "calls per step",
                      "Python frames per micro-batch", "Python frames per step",
                      "host ms per micro-batch", "host ms per step",
                      f"calls per micro-batch <= {TARGET:g}"], [
            [r["row"], f"{r['calls_micro_batch']:.3f}", f"{r['calls_step']:.3f}",
             f"{r['python_frames_micro_batch']:.3f}", f"{r['python_frames_step']:.3f}",
             f"{r['host_ms_micro_batch']:.3f}", f"{r['host_ms_step']:.3f}",
             "PASS" if r["calls_micro_batch"] <= TARGET else "FAIL"] for r in ratio_rows])
    if settings.cuda and sys.version_info < (3, 12):
        out += ["", "Python calls counted in the calling thread only (Python < 3.12): the "
                "backward's hooks on the autograd engine's CUDA thread are not in them."]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    settings = parse_args(argv)
    start(settings)
    settings.machine = machine_name(settings) + (
        "" if settings.cuda else f", {torch.get_num_threads()} torch threads")
    batches = make_batches(settings, settings.seq, settings.micro_batch, settings.accumulation,
                           settings.padding)
    started = time.perf_counter()
    print(f"bench/host_calls.py: {len(settings.rows)} rows on {settings.machine}", flush=True)
    results, failed = [], []
    for row in settings.rows:  # each in a failure boundary of its own, the JSON after each
        try:
            results.append(measure(settings, row, batches))
        except Exception as error:  # a compile error, a kernel the device lacks, ...
            lines = "".join(traceback.format_exception_only(type(error), error)).splitlines()
            failed.append({"row": row, "error": lines[:6]})
            print(f"  {row:<22} failed: {lines[0]}; going on", flush=True)
        if settings.json:
            write_atomically(settings.json, json.dumps(
                {"settings": {k: v for k, v in vars(settings).items() if k != "device"},
                 "rows": results, "ratios": ratios(results), "failed": failed,
                 "finished": row == settings.rows[-1]}, indent=1, default=str))
    text = report(settings, results, ratios(results)) + "".join(
        f"\nFailed: {f['row']}: " + " / ".join(f["error"]) for f in failed)
    print("\n" + text + f"\n({time.perf_counter() - started:.0f} s in all)")
    end_distributed()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
