"""One GPU, one run: Hugging Face's BERT with torch AMP next to our full DeepSpeed step, BERT-Large.

    deepspeed --num_gpus 1 bench/gpu.py [--json build/bench-gpu.json]   # or: python bench/gpu.py
    make bench-gpu                                                         # CPU: a tiny size

In one process, one model at a time (each engine and model freed, with the accelerator's cache,
before the next), at each sequence length (default 128 and 512, global batch 256 from micro-batches
of 64 and 16):
- `hf-bert`: transformers' BertForMaskedLM built from a BertConfig of the same size (no download),
  attn_implementation="sdpa", torch AMP (fp16 autocast + GradScaler; bf16 autocast with --dtype
  bf16), gradient clipping as the DeepSpeed config's, torch AdamW with fused=True where supported;
- our full step for each encoding (bert-a, tupe-a, tupe-r, bert-r): deepspeed.initialize on
  tupe_ds.build_model(...) with parameter_groups and the shipped BERT-Large DeepSpeed config, its
  micro-batch and gradient accumulation set so that the global batch is HF's.
Per row: ms per optimizer step (median of --steps after --warmup), samples/s, TFLOPS by Megatron's
formula (tupe_ds.train.monitor.flops_per_step), MFU against a plain matmul timed in the same run
(fp16/bf16 8192^3 on CUDA, fp32 2048^3 on a CPU), and leaf aten operators per step from
torch.profiler (a CPU-side proxy for kernel launches; on CUDA also the kernel launches). Then the
ratios with their targets (PASS/FAIL, informational: the exit code is 0), on CUDA the host
synchronisations of one step (torch.cuda.set_sync_debug_mode("warn")) and where they come from, and
with --sweep-zero-stages a ZeRO stage x micro-batch sweep of bert-a at the shortest sequence length.
Then ELECTRA-Base against BERT-Base (a CPU: the tiny pair against tiny) at the shortest sequence
length, both with --electra-encoding and their shipped configs' micro-batches, through
tupe_ds.pretrain's own step (EngineSteps, metrics included): step time, operators, host syncs,
the host time of each named phase (generator, sample, discriminator, backward, optimizer,
metrics) in one profiled step and on CUDA the device's busy time, and the ratio (target 1.5).
Batches are random masked-LM batches, about 15% of positions labelled, the same for every model:
full length with no attention mask (tupe_ds.pretrain passes none for a batch without padding), or
with --padded a random length in [seq/2, seq] each and the mask (FLOPs still count every position,
as Megatron's formula does). Our step is tupe_ds.pretrain's (its masked-LM head on the labelled
tokens only, positions taken on the host) less the accuracy metric it adds (an argmax over the
logits), so that both sides compute the loss only. Without CUDA the defaults are a tiny model
in fp32 (DeepSpeed refuses fp16 on a CPU).
"""

import argparse
import collections
import functools
import gc
import json
import os
import platform
import socket
import statistics
import time
import traceback
import warnings
import weakref
from importlib.metadata import version
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state
from transformers import BertConfig
from transformers import BertForMaskedLM as HFBertForMaskedLM

from tupe_ds.files import write_atomically
from tupe_ds.model import ModelConfig, build_model
from tupe_ds.model.config import DTYPES
from tupe_ds.model.electra import PAIRS
from tupe_ds.model.layers import labelled_positions
from tupe_ds.parallel import MegatronMPU, end_distributed
from tupe_ds.cuda_arch import fit_cuda_arch_list
from tupe_ds.train.monitor import flops_per_step
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.optim import parameter_groups
from tupe_ds.train.steps import EngineSteps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_CONFIG = "ds_configs/bert_large_fp16.json"
# The ELECTRA rows: name -> (objective, presets, shipped config), ELECTRA and the BERT of its
# discriminator's size; on a CPU the tiny pair with the same configs.
ELECTRA_CONFIG = "ds_configs/electra_base_fp16.json"
BERT_BASE_CONFIG = "ds_configs/bert_base_fp16.json"
ELECTRA_ROWS = {
    "cuda": {"electra-base": ("electra", PAIRS["electra-base"], ELECTRA_CONFIG),
             "bert-base": ("mlm", ("bert-base",), BERT_BASE_CONFIG)},
    "cpu": {"electra-tiny": ("electra", PAIRS["tiny"], ELECTRA_CONFIG),
            "bert-tiny": ("mlm", ("tiny",), BERT_BASE_CONFIG)},
}
ELECTRA_TARGET = 1.5  # ELECTRA step time at most this times BERT's of the discriminator's size
HF = "hf-bert"
CUDA_SIZE = dict(layers=24, hidden=1024, heads=16, ffn=4096, vocab=32768, seqs="128,512",
                 global_batch=256, dtype="fp16", sweep_micro_batches="32,64,128", matmul_n=8192)
CPU_SIZE = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=512, seqs="32,64", global_batch=8,
                dtype="fp32", sweep_micro_batches="2,4,8", matmul_n=2048)
# Leaf aten operators that launch no kernel: views and metadata, allocations without a fill, and
# contiguous/reshape/to when they copy nothing (when they copy, the copy is their aten child and is
# counted instead). DeepSpeed's compiled extensions (FusedAdam) are no aten operators: not counted.
NO_KERNEL_OPS = {f"aten::{name}" for name in (
    "view", "_unsafe_view", "view_as", "as_strided", "as_strided_", "_reshape_alias", "reshape",
    "detach", "detach_", "alias", "resolve_conj", "resolve_neg", "empty", "empty_strided",
    "empty_like", "resize_", "lift_fresh", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "flatten", "unflatten", "movedim", "contiguous", "to", "set_", "result_type", "size",
    "stride", "dim", "is_same_size", "_has_compatible_shallow_copy_type")}
PHASES = ("step/", "electra/")  # torch.profiler ranges of tupe_ds.train.steps and model.electra
SYNC_WARNING = "synchroniz"  # in the message of torch.cuda.set_sync_debug_mode("warn")


def int_list(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    cuda = get_accelerator().device_name() == "cuda"
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
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per row first")
    p.add_argument("--encodings", default="bert-a,tupe-a,tupe-r,bert-r")
    p.add_argument("--attention", default="fast",
                   help="ModelConfig.attention value(s), comma-separated: fast, dense")
    p.add_argument("--dtype", choices=list(DTYPES), default=size["dtype"],
                   help="fp16 / bf16: HF's autocast dtype and DeepSpeed's precision")
    p.add_argument("--ds-config", default=SHIPPED_CONFIG,
                   help="DeepSpeed config of our step; batch and precision are set from the flags")
    p.add_argument("--padded", action="store_true",
                   help="each sample a random length in [seq/2, seq], padding after it")
    p.add_argument("--matmul-n", type=int, default=size["matmul_n"], help="size of the peak matmul")
    p.add_argument("--sweep-zero-stages", default="",
                   help="e.g. 0,1,2: also time bert-a at the shortest seq, stage x micro-batch")
    p.add_argument("--sweep-micro-batches", default=size["sweep_micro_batches"])
    p.add_argument("--electra-encoding", default="tupe-r",
                   help="encoding of the ELECTRA-vs-BERT rows ('' skips them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here (PATH.tmp, then renamed)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's
    args = p.parse_args()
    args.seqs = int_list(args.seqs)
    args.encodings = [e for e in args.encodings.split(",") if e]
    args.attention = [a for a in args.attention.split(",") if a]
    args.sweep_zero_stages = int_list(args.sweep_zero_stages)
    args.sweep_micro_batches = int_list(args.sweep_micro_batches)
    if args.micro_batches is None:
        args.micro_batches = [max(1, 8192 // s) if cuda else 4 for s in args.seqs]
    else:
        args.micro_batches = int_list(args.micro_batches)
        if len(args.micro_batches) == 1:
            args.micro_batches *= len(args.seqs)
    if len(args.micro_batches) != len(args.seqs):
        p.error(f"--micro-batches: give one per sequence length ({len(args.seqs)}) or one for all")
    for micro in args.micro_batches + (args.sweep_micro_batches if args.sweep_zero_stages else []):
        if args.global_batch % micro:
            p.error(f"micro-batch {micro} does not divide --global-batch {args.global_batch}")
    if args.dtype == "fp16" and not cuda:
        p.error("--dtype fp16: DeepSpeed refuses fp16 without CUDA; use fp32 or bf16")
    return args


args = parse_args()
accelerator = get_accelerator()
accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
device = torch.device(accelerator.current_device_name())
CUDA = device.type == "cuda"


def init_distributed() -> None:
    """A 1-process group when started without a launcher (`python bench/gpu.py`)."""
    if not dist.is_initialized():
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                            ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name() if CUDA
                                   else "gloo")
    if dist.get_world_size() != 1:
        raise SystemExit("bench/gpu.py measures one GPU: run it with deepspeed --num_gpus 1")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def machine_name() -> str:
    if CUDA:
        return torch.cuda.get_device_name(device)
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"


def matmul_peak() -> float:
    """FLOP/s of a plain n^3 matmul: in the run's dtype on CUDA, fp32 on a CPU."""
    n, dtype = args.matmul_n, DTYPES[args.dtype] if CUDA else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    repeats = 50 if CUDA else 10
    for _ in range(10 if CUDA else 1):  # on a GPU also to let the clocks rise
        a @ b
    accelerator.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    accelerator.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def model_config(seq: int, encoding: str, attention: str) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                       vocab_size=args.vocab, max_position_embeddings=max(512, max(args.seqs)),
                       seq_length=seq, pos_encoding=encoding, attention=attention, dtype=args.dtype)


def make_batches(seq: int, micro: int, count: int) -> list:
    """`count` micro-batches (ids, attention mask, labels, labelled positions) of random tokens,
    ~15% labelled. As tupe_ds.pretrain does for ours: the mask is None without padding (for both
    models), and the positions of the labelled tokens are taken on the host (labelled_positions)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + seq)
    batches = []
    for _ in range(count):
        ids = torch.randint(10, args.vocab, (micro, seq), generator=g)
        labelled = torch.rand(micro, seq, generator=g) < 0.15
        mask = None
        if args.padded:
            lengths = torch.randint(seq // 2, seq + 1, (micro, 1), generator=g)
            mask = (torch.arange(seq)[None] < lengths).long()
            ids, labelled = ids * mask, labelled & mask.bool()
            mask = mask.to(device)
        labels = ids.masked_fill(~labelled, -100)
        positions = labelled_positions(labels)
        batches.append((ids.to(device), mask, labels.to(device), positions.to(device)))
    return batches


def ds_config(micro: Optional[int], zero_stage=None, path: Optional[str] = None) -> dict:
    """The config at `path` (default --ds-config) with the run's global batch, precision and
    `micro` (None: the config's own micro-batch)."""
    path = path or args.ds_config
    with open(path if os.path.isabs(path) else os.path.join(ROOT, path)) as f:
        config = json.load(f)
    micro = micro or config["train_micro_batch_size_per_gpu"]
    config["train_batch_size"] = args.global_batch
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = args.global_batch // micro
    config["steps_per_print"] = 10**9
    config.setdefault("fp16", {})["enabled"] = args.dtype == "fp16"
    config.setdefault("bf16", {})["enabled"] = args.dtype == "bf16"
    if zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
    return config


def fused_adamw_supported() -> bool:
    try:
        weight = torch.zeros(2, device=device, requires_grad=True)
        weight.grad = torch.ones_like(weight)
        torch.optim.AdamW([weight], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


class HFRunner:
    """BertForMaskedLM, torch AMP, clipping, torch AdamW: the step a Hugging Face user writes."""

    def __init__(self, seq: int, batches: list, ds_config: dict):
        torch.manual_seed(args.seed)
        config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            intermediate_size=args.ffn, hidden_act="gelu",
                            max_position_embeddings=max(512, max(args.seqs)),
                            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                            attn_implementation="sdpa")
        self.model = HFBertForMaskedLM(config).to(device)  # fp32 weights, built from config
        self.model.train()
        hyper = ds_config["optimizer"]["params"]  # the same lr, betas, eps and weight decay
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, hyper.get("weight_decay", 0.01)), lr=hyper.get("lr", 1e-4),
            betas=tuple(hyper.get("betas", (0.9, 0.999))), eps=hyper.get("eps", 1e-8),
            fused=FUSED or None)
        self.autocast = DTYPES[args.dtype] if args.dtype != "fp32" else None
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
        self.batches, self.clipping = batches, ds_config.get("gradient_clipping", 1.0)
        self.flops = flops_per_step(model_config(seq, "bert-a", args.attention[0]),
                                    args.global_batch, seq)

    def step(self) -> None:
        for ids, mask, labels, _ in self.batches:
            with torch.autocast(device.type, dtype=self.autocast,
                                enabled=self.autocast is not None):
                loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            self.scaler.scale(loss / len(self.batches)).backward()
        if self.clipping > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def module(self) -> torch.nn.Module:
        return self.model

    def close(self) -> None:
        self.model = self.optimizer = self.scaler = self.batches = None


class OursRunner:
    """tupe_ds.build_model under deepspeed.initialize: the step tupe_ds.pretrain runs."""

    def __init__(self, seq: int, batches: list, encoding: str, attention: str, config: dict):
        torch.manual_seed(args.seed)
        model = build_model(model_config(seq, encoding, attention))
        weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=parameter_groups(model, weight_decay), config=config,
            mpu=MegatronMPU())
        self.batches = batches
        self.flops = flops_per_step(model.model_config, args.global_batch, seq)

    def step(self) -> None:
        for ids, mask, labels, positions in self.batches:
            loss, _ = self.engine(ids, mask, labels, positions)
            self.engine.backward(loss)
            self.engine.step()

    def module(self) -> torch.nn.Module:
        return self.engine.module

    def close(self) -> None:
        self.engine.destroy()
        self.engine = self.batches = None


class TrainingStepRunner:
    """tupe_ds.pretrain's own step (EngineSteps: host copies of the batches, labelled positions
    and the no-padding check taken there, the objective's metrics added per micro-batch) on the
    presets of `objective` with a shipped config: the ELECTRA-vs-BERT rows."""

    def __init__(self, objective: str, presets: tuple, seq: int, batches: list, config: dict):
        torch.manual_seed(args.seed)
        models = [ModelConfig.from_preset(
            preset, pos_encoding=args.electra_encoding, vocab_size=args.vocab, seq_length=seq,
            max_position_embeddings=max(512, seq), dtype=args.dtype) for preset in presets]
        objective = OBJECTIVES[objective]
        model = objective.build(models)
        weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=parameter_groups(model, weight_decay), config=config,
            mpu=MegatronMPU())
        self.steps = EngineSteps(self.engine, objective, device)
        self.batches = [{"input_ids": ids.cpu(), "labels": labels.cpu(), "attention_mask":
                         torch.ones_like(ids.cpu()) if mask is None else mask.cpu()}
                        for ids, mask, labels, _ in batches]
        self.flops = sum(flops_per_step(m, args.global_batch, seq) for m in models)

    def step(self) -> None:
        self.steps.train(self.batches, {})

    def module(self) -> torch.nn.Module:
        return self.engine.module

    def close(self) -> None:
        self.engine.destroy()
        self.engine = self.steps = self.batches = None


def timed_steps(step) -> list:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        accelerator.synchronize()
        start = time.perf_counter()
        step()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return times


def count_ops(step) -> dict:
    """Leaf aten operators (aten events with no aten descendant, less NO_KERNEL_OPS) of one step;
    on CUDA also the kernel launches the runtime saw."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if CUDA:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        accelerator.synchronize()
    events = prof.events()
    not_leaf = set()
    for event in events:
        if event.name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if parent is not None:
                not_leaf.add(id(parent))
    names = collections.Counter(e.name for e in events if e.name.startswith("aten::")
                                and id(e) not in not_leaf and e.name not in NO_KERNEL_OPS)
    result = {"ops": sum(names.values()), "op_names": dict(names.most_common())}
    phases = {}  # tupe_ds's named phases (EngineSteps, ELECTRA's forward): host ms, calls
    for event in events:
        if event.name.startswith(PHASES):
            phase = phases.setdefault(event.name, {"host_ms": 0.0, "calls": 0})
            phase["host_ms"] += event.cpu_time_total / 1e3
            phase["calls"] += 1
    if phases:
        result["phases"] = phases
    if CUDA:
        result["launches"] = sum(1 for e in events if "LaunchKernel" in e.name
                                 or e.name == "cudaGraphLaunch")
        result["device_busy_ms"] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return result


def short_path(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else path


def count_syncs(step) -> dict:
    """Host synchronisations of one step, by the first frame outside torch that asked for them."""
    torch_dir = os.path.dirname(torch.__file__)
    locations = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return
        where = f"{short_path(filename)}:{lineno}"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if not frame.filename.startswith(torch_dir) and frame.filename != warnings.__file__:
                where = f"{short_path(frame.filename)}:{frame.lineno}"
                break
        locations[where] = locations.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    accelerator.synchronize()  # outside: this one is ours
    return {"syncs": sum(locations.values()),
            "sync_locations": dict(sorted(locations.items(), key=lambda kv: -kv[1]))}


def measure(name: str, seq: int, micro: int, make_runner, profile: bool = True) -> dict:
    """Build, time, count, free: one row."""
    if CUDA:
        accelerator.reset_peak_memory_stats()
    runner = make_runner()
    times = timed_steps(runner.step)
    seconds = statistics.median(times)
    row = {"model": name, "seq": seq, "micro_batch": micro,
           "accumulation": args.global_batch // micro, "ms_per_step": seconds * 1e3,
           "min_ms": min(times) * 1e3, "samples_per_s": args.global_batch / seconds,
           "tflops": runner.flops / seconds / 1e12, "mfu": runner.flops / seconds / PEAK}
    if CUDA:
        row["peak_gib"] = accelerator.max_memory_allocated() / 2**30
    if hasattr(runner, "engine"):
        row["skipped_steps"] = runner.engine.skipped_steps
    if profile:
        row.update(count_ops(runner.step))
        if CUDA:
            row.update(count_syncs(runner.step))
    module = weakref.ref(runner.module())
    runner.close()
    del runner
    gc.collect()
    accelerator.empty_cache()
    if module() is not None:
        print(f"warning: {name} at seq {seq} is still referenced after closing: the next models "
              "may run out of memory")
    print(f"  {name:<16} seq {seq:<4} micro {micro:<4} {row['ms_per_step']:9.1f} ms/step "
          f"{row['samples_per_s']:9.1f} samples/s", flush=True)
    return row


def ours_name(encoding: str, attention: str) -> str:
    return encoding if len(args.attention) == 1 else f"{encoding}/{attention}"


def run_table() -> list:
    rows = []
    for seq, micro in zip(args.seqs, args.micro_batches):
        batches = make_batches(seq, micro, args.global_batch // micro)
        config = ds_config(micro)
        rows.append(measure(HF, seq, micro, functools.partial(HFRunner, seq, batches, config)))
        for attention in args.attention:
            for encoding in args.encodings:
                rows.append(measure(ours_name(encoding, attention), seq, micro, functools.partial(
                    OursRunner, seq, batches, encoding, attention, config)))
    return rows


def run_sweep() -> list:
    seq, rows = min(args.seqs), []
    for stage in args.sweep_zero_stages:
        for micro in args.sweep_micro_batches:
            batches = make_batches(seq, micro, args.global_batch // micro)
            config = ds_config(micro, zero_stage=stage)
            row = measure(f"bert-a zero{stage}", seq, micro, functools.partial(
                OursRunner, seq, batches, "bert-a", args.attention[0], config), profile=False)
            rows.append({**row, "zero_stage": stage})
    return rows


def run_electra() -> list:
    """ELECTRA and the BERT of its discriminator's size at the shortest seq, each with its shipped
    config's micro-batch (on a CPU: the tiny pair, --micro-batches)."""
    if not args.electra_encoding:
        return []
    seq, rows = min(args.seqs), []
    for name, (objective, presets, path) in ELECTRA_ROWS["cuda" if CUDA else "cpu"].items():
        config = ds_config(None if CUDA else args.micro_batches[0], path=path)
        micro = config["train_micro_batch_size_per_gpu"]
        batches = make_batches(seq, micro, args.global_batch // micro)
        rows.append({**measure(name, seq, micro, functools.partial(
            TrainingStepRunner, objective, presets, seq, batches, config)), "config": path})
    return rows


def print_electra(rows: list) -> None:
    electra, bert = rows
    print(f"ELECTRA against BERT of its discriminator's size ({args.electra_encoding}, "
          f"tupe_ds.pretrain's step with its metrics, shipped configs, seq {electra['seq']}, "
          f"global batch {args.global_batch}):")
    for r in rows:
        launches = f", {r['launches']} launches" if "launches" in r else ""
        syncs = f", {r['syncs']} host syncs" if "syncs" in r else ""
        print(f"  {r['model']:<14} micro {r['micro_batch']:<4} x {r['accumulation']:<3}"
              f"{r['ms_per_step']:10.1f} ms/step {r['samples_per_s']:9.1f} samples/s "
              f"{r['ops']:>7} ops{launches}{syncs}  ({r['config']})")
    for r in rows:
        busy = f"; device busy {r['device_busy_ms']:.1f} ms" if "device_busy_ms" in r else ""
        print(f"  {r['model']} phases of one profiled step, host ms (calls){busy}:")
        print("    " + ", ".join(f"{name} {p['host_ms']:.1f} ({p['calls']})"
                                 for name, p in r.get("phases", {}).items()))
    ratio = electra["ms_per_step"] / bert["ms_per_step"]
    print(f"  {electra['model']} / {bert['model']} step time {ratio:.3f}  target <= "
          f"{ELECTRA_TARGET:.2f}: {'PASS' if ratio <= ELECTRA_TARGET else 'FAIL'}")


def target_seq() -> int:
    """The step-time targets are for seq 512; without 512 in --seqs, the longest measured."""
    return 512 if 512 in args.seqs else max(args.seqs)


def ratios(rows: list) -> list:
    """name, seq, value, target (None: informational), pass."""
    by = {(r["model"], r["seq"]): r for r in rows}
    out = []

    def add(name, seq, value, target, at_most, detail=""):
        passed = None if target is None else (value <= target if at_most else value >= target)
        out.append({"name": name, "seq": seq, "value": value, "target": target,
                    "at_most": at_most, "pass": passed, "detail": detail})

    for seq in args.seqs:
        hf = by.get((HF, seq))
        for attention in args.attention:
            names = {e: ours_name(e, attention) for e in args.encodings}
            for encoding, name in names.items():
                add(f"{name} / {HF} samples/s", seq,
                    by[(name, seq)]["samples_per_s"] / hf["samples_per_s"], 1.1, False)
            base = by.get((ours_name("bert-a", attention), seq))
            for encoding, target in (("tupe-a", 1.05), ("tupe-r", 1.15)):
                if base and encoding in names:
                    add(f"{names[encoding]} / {base['model']} step time", seq,
                        by[(names[encoding], seq)]["ms_per_step"] / base["ms_per_step"],
                        target if seq == target_seq() else None, True)
            for encoding in ("bert-a", "tupe-r"):
                if encoding in names and "ops" in hf:
                    ops = by[(names[encoding], seq)]["ops"]
                    add(f"{names[encoding]} / {HF} ops per step", seq, ops / hf["ops"], 1.0, True,
                        f" ({ops} / {hf['ops']})")
    return out


def print_table(rows: list) -> None:
    hf = {r["seq"]: r for r in rows if r["model"] == HF}
    cuda = f"{'launches':>9}{'peak GiB':>9}" if CUDA else ""
    print(f"{'model':<16}{'seq':>5}{'micro x acc':>12}{'ms/step':>10}{'samples/s':>11}"
          f"{'TFLOPS':>9}{'MFU':>7}{'ops/step':>9}{cuda}{'/ HF':>7}")
    for r in rows:
        cuda = f"{r['launches']:>9}{r['peak_gib']:>9.1f}" if CUDA else ""
        tflops = f"{r['tflops']:.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.4f}"
        versus_hf = r["samples_per_s"] / hf[r["seq"]]["samples_per_s"]
        print(f"{r['model']:<16}{r['seq']:>5}{r['micro_batch']:>7} x {r['accumulation']:<2}"
              f"{r['ms_per_step']:>10.1f}{r['samples_per_s']:>11.1f}{tflops:>9}{r['mfu']:>7.1%}"
              f"{r['ops']:>9}{cuda}{versus_hf:>7.3f}")
    skipped = [f"{r['model']} seq {r['seq']}: {r['skipped_steps']}" for r in rows
               if r.get("skipped_steps")]
    if skipped:
        print("optimizer steps DeepSpeed skipped (fp16 overflow; warm-up and timed steps): "
              + ", ".join(skipped))


def print_ratios(ratio_rows: list) -> None:
    print(f"ratios (targets: ours / HF samples/s >= 1.1; tupe-a, tupe-r / bert-a step time <= "
          f"1.05, 1.15 at seq {target_seq()}; ops per step <= HF's). Informational: the exit code "
          "is 0 either way.")
    for r in ratio_rows:
        line = f"  seq {r['seq']:<4} {r['name']:<38} {r['value']:7.3f}{r['detail']}"
        if r["target"] is not None:
            sign = "<=" if r["at_most"] else ">="
            line += f"  target {sign} {r['target']:.2f}: {'PASS' if r['pass'] else 'FAIL'}"
        print(line)


def print_op_excess(rows: list) -> None:
    """Where our step has more operators than HF's: the names with the largest excess."""
    hf = {r["seq"]: r["op_names"] for r in rows if r["model"] == HF}
    print(f"operators per step above {HF}'s (leaf aten ops by name, ours - HF's):")
    for r in rows:
        if r["model"] == HF or r["model"].split("/")[0] not in ("bert-a", "tupe-r"):
            continue
        theirs = hf[r["seq"]]
        excess = {name: count - theirs.get(name, 0) for name, count in r["op_names"].items()
                  if count > theirs.get(name, 0)}
        top = sorted(excess.items(), key=lambda kv: -kv[1])[:8]
        print(f"  {r['model']:<16} seq {r['seq']:<4} "
              + ", ".join(f"{name[len('aten::'):]} +{count}" for name, count in top))


def print_syncs(rows: list) -> None:
    print("host synchronisations in one step (torch.cuda.set_sync_debug_mode), by the first frame "
          "outside torch:")
    if not CUDA:
        print("  not counted: this needs CUDA")
    for r in rows:
        if "syncs" in r:
            top = list(r["sync_locations"].items())[:6]
            places = ", ".join(f"{where} x{n}" for where, n in top)
            print(f"  {r['model']:<16} seq {r['seq']:<4} {r['syncs']:>4}"
                  + (f": {places}" if places else ""))


def print_sweep(sweep: list) -> None:
    print(f"sweep, bert-a at seq {sweep[0]['seq']}, global batch {args.global_batch}: "
          "samples/s (TFLOPS)")
    print(f"{'ZeRO stage':<12}"
          + "".join(f"{'micro ' + str(m):>20}" for m in args.sweep_micro_batches))
    for stage in args.sweep_zero_stages:
        cells = {r["micro_batch"]: r for r in sweep if r["zero_stage"] == stage}
        print(f"{stage:<12}" + "".join(
            f"{cells[m]['samples_per_s']:.1f} ({cells[m]['tflops']:.3g})".rjust(20)
            for m in args.sweep_micro_batches))
    best = max(sweep, key=lambda r: r["samples_per_s"])
    print(f"fastest: ZeRO stage {best['zero_stage']}, micro-batch {best['micro_batch']} "
          f"({best['samples_per_s']:.1f} samples/s)")


def ours_optimizer(config: dict) -> str:
    params = config["optimizer"].get("params", {})
    if params.get("torch_adam"):
        return f"torch {config['optimizer']['type']}" + (" (fused)" if params.get("fused") else "")
    return f"{config['optimizer']['type']} (DeepSpeed's FusedAdam)"


def header(config: dict) -> dict:
    threads = "" if CUDA else f", {torch.get_num_threads()} torch threads"
    hf_precision = f"torch AMP {args.dtype}" if args.dtype != "fp32" else "fp32"
    return {
        "machine": f"{machine_name()}; device {device}{threads}",
        "versions": f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, megatron-core "
                    f"{version('megatron-core')}, transformers {version('transformers')}",
        "size": f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, "
                f"vocab {args.vocab}; global batch {args.global_batch}, seqs {args.seqs}, "
                f"micro-batches {args.micro_batches}; "
                + ("padded to random lengths" if args.padded else "full length, no mask"),
        "precision": f"{args.dtype}; attention {', '.join(args.attention)}",
        "ours": f"{args.ds_config}, ZeRO stage "
                f"{config.get('zero_optimization', {}).get('stage', 0)}, optimizer "
                f"{ours_optimizer(config)}, gradient clipping "
                f"{config.get('gradient_clipping', 1.0)}",
        "HF": f"BertForMaskedLM sdpa, {hf_precision}, torch AdamW"
              + (" (fused)" if FUSED else " (not fused: unsupported here)") + ", same clipping",
        "timing": f"median of {args.steps} optimizer steps after {args.warmup} warm-up, one model "
                  "at a time",
        "peak": f"plain {args.matmul_n}^3 {args.dtype if CUDA else 'fp32'} matmul: "
                f"{PEAK / 1e12:.2f} TFLOPS",
    }


def main() -> None:
    for encoding in args.encodings:  # a wrong name fails here, not after the first models
        for attention in args.attention:
            model_config(max(args.seqs), encoding, attention)
    head = header(ds_config(args.micro_batches[0]))
    print("\n".join(f"{key}: {value}" for key, value in head.items()), flush=True)
    arch_note = fit_cuda_arch_list()  # as tupe_ds.pretrain: before DeepSpeed builds an extension
    if arch_note:
        print(arch_note)
    print("measuring:", flush=True)
    rows = run_table()
    electra = run_electra()
    sweep = run_sweep()
    ratio_rows = ratios(rows)
    print()
    print_table(rows)
    print()
    print_ratios(ratio_rows)
    print()
    print_op_excess(rows)
    print()
    print_syncs(rows + electra)
    if electra:
        print()
        print_electra(electra)
    if sweep:
        print()
        print_sweep(sweep)
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "local_rank"}
        result = {"header": head, "peak_flops": PEAK, "args": settings, "rows": rows,
                  "ratios": ratio_rows, "electra": electra, "sweep": sweep}
        write_atomically(args.json, json.dumps(result, indent=1))
    end_distributed()


init_distributed()
PEAK = matmul_peak()  # FLOP/s
FUSED = fused_adamw_supported()
main()
