"""One GPU, one run: Hugging Face's BERT with torch AMP next to our full DeepSpeed step, BERT-Large.

    deepspeed --num_gpus 1 --module bench.gpu.step_time [--json build/bench-gpu.json]   # or: python -m bench.gpu.step_time
    make bench-gpu                                                         # CPU: a tiny size

In one process, one model at a time (each engine and model freed, with the accelerator's cache
and torch.compile's graphs, before the next), at each sequence length (default 128 and 512,
global batch 256), once per --padding (default: the loader's real padding, then none):
- `hf-bert`: transformers' BertForMaskedLM built from a BertConfig of the same size (no download),
  attn_implementation="sdpa", torch AMP (fp16 autocast + GradScaler; bf16 autocast with --dtype
  bf16), gradient clipping as the DeepSpeed config's, torch AdamW with fused=True where supported;
- our full step for each encoding (bert-a, tupe-a, tupe-r, bert-r): deepspeed.initialize on
  tupe_ds.build_model(...) with parameter_groups and the shipped BERT-Large DeepSpeed config, its
  micro-batch and gradient accumulation set so that the global batch is HF's; compiled as
  ModelConfig chooses for the device (--compile: block on CUDA, none on a CPU).
Micro-batches: every model at the like-for-like one (--micro-batches: 8192 tokens on CUDA, 64 at
seq 128 and 16 at 512); the --sweep-models (HF and bert-a) also at that times each
--sweep-factors (2, 4), on the same model, smallest first, until one runs out of memory (it
does not fit). A model's best is its fastest micro-batch that fits.
Per row: ms per optimizer step (median of --steps after --warmup, at least 2: the first compiles),
samples/s, TFLOPS by Megatron's formula (tupe_ds.train.monitor.flops_per_step), MFU against a
plain matmul timed in the same run (fp16/bf16 8192^3 on CUDA, fp32 2048^3 on a CPU), the first
warm-up step's seconds (compiles included). At each model's first micro-batch also: leaf aten
operators per step from torch.profiler (an operator whose aten children only allocate counts; a
CPU-side proxy for kernel launches; on CUDA also the kernel launches and the device's busy time,
the union of its kernel intervals, over the step's span), host ms per phase (forward, backward,
the boundary: bench/gpu/phases.py) against, on CUDA, device ms between CUDA events, and on CUDA
the host synchronisations of one step (torch.cuda.set_sync_debug_mode("warn")) and where they
come from. Then the verdicts (PASS/FAIL, informational: the exit code is 0): the headline, each
encoding at its best against HF at its best (samples/s >= 1.1); at the like-for-like micro-batch
ours / HF (informational), tupe-a and tupe-r against bert-a, operators against HF's. With
--sweep-zero-stages a ZeRO stage x micro-batch sweep of bert-a at the shortest sequence length
(first --padding only; one model per stage).
Then ELECTRA-Base against BERT-Base (a CPU: the tiny pair against tiny) at the shortest sequence
length, both with --electra-encoding and their shipped configs' micro-batches ("auto": swept as
above), through tupe_ds.pretrain's own step (EngineSteps, metrics included): step time,
operators, host syncs, the host time of each named phase (generator, sample, discriminator,
backward, optimizer, metrics) in one profiled step and on CUDA the device's busy time, and the
ratio at each one's best (target 1.5).
Batches are random masked-LM batches, about 15% of the real positions labelled, the same for
every model: `real` gives each sample a length drawn from what the training loader gives
(bench/real_lengths.py) and passes the mask; `none` is full length with no attention mask
(tupe_ds.pretrain passes none for a batch without padding). FLOPs count every position, as
Megatron's formula does. Our step is tupe_ds.pretrain's (its masked-LM head on the labelled
tokens only, positions taken on the host) less the accuracy metric it adds. Without CUDA the
defaults are a tiny model in fp32 (DeepSpeed refuses fp16 on a CPU).
"""

import argparse
import json
import os
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from bench.gpu.measure import BUILDS, init_distributed, matmul_peak
from bench.gpu.report import header, report, result_verdicts
from bench.gpu.runners import PADDINGS, ds_config, fused_adamw_supported, model_config
from tupe_ds.distributed.parallel import end_distributed
from tupe_ds.machine.cuda_arch import fit_cuda_arch_list
from tupe_ds.model.config import COMPILE, DTYPES
from tupe_ds.tools.files import write_atomically

SHIPPED_CONFIG = "ds_configs/bert_large_fp16.json"
CUDA_SIZE = dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=32768, seqs="128,512",
                 global_batch=256, dtype="fp16", sweep_micro_batches="32,64,128", matmul_n=8192,
                 sweep_factors="2,4")
CPU_SIZE = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=512, seqs="32,64", global_batch=8,
                dtype="fp32", sweep_micro_batches="2,4,8", matmul_n=2048, sweep_factors="2")
MIN_WARMUP = 2  # the first step compiles (and for ours DeepSpeed sets up); the second settles


def int_list(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def name_list(text: str) -> list:
    return [x for x in text.split(",") if x]


def on_cuda() -> bool:
    return get_accelerator().device_name() == "cuda"


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    """The run's settings: the flags, lists parsed, micro-batches filled in."""
    cuda = on_cuda()
    size = CUDA_SIZE if cuda else CPU_SIZE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=size["layers"])
    p.add_argument("--hidden", type=int, default=size["hidden"])
    p.add_argument("--heads", type=int, default=size["heads"])
    p.add_argument("--ffn", type=int, default=size["ffn"])
    p.add_argument("--vocab", type=int, default=size["vocab"])
    p.add_argument("--seqs", default=size["seqs"], help="comma-separated sequence lengths")
    p.add_argument("--global-batch", type=int, default=size["global_batch"])
    p.add_argument("--micro-batches", help="one per sequence length, or one for all (default: "
                   "8192 tokens per micro-batch on CUDA, i.e. 64 at 128 and 16 at 512; 4 on a CPU)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=int, default=3,
                   help=f"untimed optimizer steps per row first (at least {MIN_WARMUP})")
    p.add_argument("--encodings", default="bert-a,tupe-a,tupe-r,bert-r")
    p.add_argument("--sweep-factors", default=size["sweep_factors"],
                   help="the --sweep-models also run at their micro-batch times each of these "
                        "(ascending, each a whole multiple of the one before; on the same "
                        "model): each model's best is the fastest that fits")
    p.add_argument("--sweep-models", default="hf-bert,bert-a",
                   help="the table's models swept over --sweep-factors (the others run at "
                        "--micro-batches only)")
    p.add_argument("--compile", choices=list(COMPILE), default=None,
                   help="ModelConfig.compile of our models (default: the device's choice, "
                        "ModelConfig.compile_mode: block on CUDA at tp 1, none on a CPU)")
    p.add_argument("--attention", default="fast",
                   help="ModelConfig.attention value(s), comma-separated: fast, dense")
    p.add_argument("--padding", default="real,none",
                   help="comma-separated, a row each: real (sample lengths as the training "
                        "loader gives them, bench/real_lengths.py), none (full length, no mask)")
    p.add_argument("--profiled-paddings", default=None,
                   help="the --padding rows whose step is also profiled for operator and host-"
                        "synchronisation counts (default: all)")
    p.add_argument("--dtype", choices=list(DTYPES), default=size["dtype"],
                   help="fp16 / bf16: HF's autocast dtype and DeepSpeed's precision")
    p.add_argument("--ds-config", default=SHIPPED_CONFIG,
                   help="DeepSpeed config of our step; batch and precision are set from the flags")
    p.add_argument("--matmul-n", type=int, default=size["matmul_n"], help="size of the peak matmul")
    p.add_argument("--sweep-zero-stages", default="",
                   help="e.g. 0,1,2: also time bert-a at the shortest seq, stage x micro-batch")
    p.add_argument("--sweep-micro-batches", default=size["sweep_micro_batches"])
    p.add_argument("--electra-encoding", default="tupe-r",
                   help="encoding of the ELECTRA-vs-BERT rows ('' skips them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here (PATH.tmp, then renamed)")
    p.add_argument("--markdown", help="also write the report here")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's
    settings = p.parse_args(argv)
    settings.seqs = int_list(settings.seqs)
    settings.encodings = name_list(settings.encodings)
    settings.attention = name_list(settings.attention)
    settings.padding = name_list(settings.padding)
    settings.profiled_paddings = (settings.padding if settings.profiled_paddings is None
                                  else name_list(settings.profiled_paddings))
    settings.sweep_zero_stages = int_list(settings.sweep_zero_stages)
    settings.sweep_micro_batches = int_list(settings.sweep_micro_batches)
    settings.sweep_factors = int_list(settings.sweep_factors)
    settings.sweep_models = name_list(settings.sweep_models)
    if settings.micro_batches is None:
        settings.micro_batches = [max(1, 8192 // s) if cuda else 4 for s in settings.seqs]
    else:
        settings.micro_batches = int_list(settings.micro_batches)
        if len(settings.micro_batches) == 1:
            settings.micro_batches *= len(settings.seqs)
    settings.cuda = cuda
    check(p, settings, cuda)
    return settings


def check(parser: argparse.ArgumentParser, settings: argparse.Namespace, cuda: bool) -> None:
    """Whatever would fail only after the first models, fail now."""
    if len(settings.micro_batches) != len(settings.seqs):
        parser.error(f"--micro-batches: give one per sequence length ({len(settings.seqs)}) or "
                     "one for all")
    if settings.warmup < MIN_WARMUP:
        parser.error(f"--warmup: at least {MIN_WARMUP}")
    sweeps = [[micro * f for f in [1, *settings.sweep_factors]]
              for micro in settings.micro_batches]
    if settings.sweep_zero_stages:
        sweeps.append(settings.sweep_micro_batches)
    for micros in sweeps:
        for micro in micros:
            if settings.global_batch % micro:
                parser.error(f"micro-batch {micro} does not divide --global-batch "
                             f"{settings.global_batch}")
        for smaller, larger in zip(micros, micros[1:]):
            if larger <= smaller or larger % smaller:  # runners.use_micro_batch's condition
                parser.error(f"micro-batches {micros}: each must be a whole multiple (> 1) of "
                             "the one before")
    if settings.dtype == "fp16" and not cuda:
        parser.error("--dtype fp16: DeepSpeed refuses fp16 without CUDA; use fp32 or bf16")
    unknown = set(settings.padding) - set(PADDINGS)
    if unknown or not settings.padding:
        parser.error(f"--padding: one or more of {', '.join(PADDINGS)}")
    for encoding in settings.encodings:
        for attention in settings.attention:
            try:
                model_config(settings, max(settings.seqs), encoding, attention, settings.compile)
            except ValueError as error:
                parser.error(str(error))


PARTS = {"table": "rows", "electra": "electra", "sweep": "sweep"}  # each part's list in the JSON


def start(settings: argparse.Namespace) -> dict:
    """The process group, the matmul peak and the header (printed); the result with no rows yet.
    Sets the machine's facts on `settings` (device, cuda, peak_flops, fused_adamw): the
    measurements read them there."""
    arguments = {key: value for key, value in vars(settings).items() if key != "local_rank"}
    accelerator = get_accelerator()
    accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    settings.device = torch.device(accelerator.current_device_name())
    init_distributed(settings.cuda)
    settings.peak_flops = matmul_peak(settings)  # FLOP/s
    settings.fused_adamw = fused_adamw_supported(settings.device)
    head = header(settings, ds_config(settings, settings.micro_batches[0]))
    print("\n".join(f"{key}: {value}" for key, value in head.items()), flush=True)
    arch_note = fit_cuda_arch_list()  # as tupe_ds.pretrain: before DeepSpeed builds an extension
    if arch_note:
        print(arch_note)
    print("measuring:", flush=True)
    return {"header": head, "peak_flops": settings.peak_flops, "args": arguments,
            **{rows: [] for rows in PARTS.values()}}


def run(settings: argparse.Namespace, parts=tuple(PARTS)) -> dict:
    """The measurements of `parts` and their verdicts, as the JSON holds them."""
    result = start(settings)
    for part in parts:
        result[PARTS[part]] = [row for build in BUILDS[part](settings)
                               for row in build.measure(settings)]
    result["verdicts"] = result_verdicts(settings, result)
    return result


def main(argv: Optional[list] = None) -> None:
    settings = parse_args(argv)
    result = run(settings)
    text = report(settings, result)
    print("\n" + text, end="")
    if settings.json:
        write_atomically(settings.json, json.dumps(result, indent=1))
    if settings.markdown:
        write_atomically(settings.markdown, text)
    end_distributed()


if __name__ == "__main__":
    main()
