"""Command line and DeepSpeed config of a pretraining run, validated before any heavy work."""

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from tokenizers import Tokenizer

from tupe_ds import doctor
from tupe_ds.launch import processes_on_this_node
from tupe_ds.model.config import ENCODINGS, PRESETS, ModelConfig
from tupe_ds.model.electra import PAIRS
from tupe_ds.train import reshard
from tupe_ds.train.checkpoint import latest_tag

CPU_CONFIG = doctor.CPU_CONFIG
DATA_STREAMS = {
    "vectorised": "each micro-batch read and masked in whole-batch operations",
    "per-sample": "the reference: sample by sample (the same batches, slower)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tupe-pretrain",
        description="Masked-LM pretraining with DeepSpeed. Start it with `deepspeed --num_gpus N "
                    "--module tupe_ds.pretrain ...` or `torchrun --nproc_per_node N -m "
                    "tupe_ds.pretrain ...`.")
    p.add_argument("--data", required=True, help="a folder written by tupe-prep")
    p.add_argument("--objective", default="mlm", choices=["mlm", "electra"],
                   help="mlm: BERT masked LM; electra: generator + discriminator")
    p.add_argument("--model", default="bert-base", choices=sorted(set(PRESETS) | set(PAIRS)),
                   help="a preset; with --objective electra a pair: electra-base or tiny")
    p.add_argument("--pos-encoding", default="tupe-r", choices=list(ENCODINGS))
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON config (ds_configs/)")
    p.add_argument("--out", required=True, help="run folder: checkpoints/, tensorboard/, log")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (BERT, --objective mlm; ZeRO stage 0 or 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                   help="overrides zero_optimization.stage")
    p.add_argument("--steps", type=int, required=True,
                   help="total optimizer steps of the run; a larger value resumes and goes on")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--index-cache", metavar="DIR",
                   help="folder of the sample indexes (built once per dataset and seq-len, "
                        "memory-mapped by every process); default: --data when writable, else "
                        "OUT/index-cache")
    p.add_argument("--prefetch", type=int, default=2,
                   help="optimizer steps of batches a background thread makes ahead (0: made "
                        "in the step)")
    p.add_argument("--data-stream", choices=list(DATA_STREAMS), default="vectorised",
                   help="; ".join(f"{name}: {text}" for name, text in DATA_STREAMS.items()))
    p.add_argument("--micro-batch", type=int, help="overrides train_micro_batch_size_per_gpu")
    p.add_argument("--global-batch", type=int, help="overrides train_batch_size")
    p.add_argument("--lr", type=float, help="overrides the peak learning rate")
    p.add_argument("--warmup-steps", type=int, help="overrides the scheduler's warmup_num_steps")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--eval-interval", type=int, default=1000, help="steps between validations")
    p.add_argument("--eval-samples", type=int, default=256, help="valid samples per validation")
    p.add_argument("--save-interval", type=int, default=1000, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="complete checkpoints kept")
    p.add_argument("--log-interval", type=int, default=10, help="steps between log lines")
    p.add_argument("--image-interval", type=int, default=1000,
                   help="steps between images of the positional logits in TensorBoard")
    p.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from the latest complete checkpoint in --out")
    p.add_argument("--check-only", action="store_true",
                   help="check the command, data and DeepSpeed config for WORLD_SIZE processes, "
                        "then exit (what slurm/pretrain.sbatch does before starting the tasks)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's
    return p


@dataclass(frozen=True)
class Layout:
    """How the run's processes split the work: tensor x pipeline x data parallel."""
    world_size: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def __str__(self) -> str:
        return f"tp {self.tp}, pp {self.pp}, dp {self.dp}"


@dataclass(frozen=True)
class Intervals:
    """Steps between log lines, validations, checkpoints and positional images."""
    log: int
    eval: int
    save: int
    image: int


@dataclass(frozen=True)
class RunConfig:
    objective: str  # a key of tupe_ds.train.objectives.OBJECTIVES
    model: str  # the preset (or ELECTRA pair) name
    data: str
    out: str
    steps: int
    seq_len: int
    seed: int
    eval_samples: int
    keep_checkpoints: int
    resume: bool
    check_only: bool
    layout: Layout
    intervals: Intervals
    models: tuple  # (ModelConfig,) for mlm; (discriminator, generator) for electra
    ds_config: dict  # with the command line's overrides
    ds_config_path: str
    index_cache: str  # folder of the sample indexes
    prefetch: int  # steps of batches made ahead by a thread
    vectorised_stream: bool  # --data-stream vectorised
    resharding: Optional[reshard.Reshard] = None  # resuming a checkpoint of another layout

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp


def fail(message: str):
    raise SystemExit(f"tupe-pretrain: error: {message}")


def load(argv=None, world_size: Optional[int] = None,
         machine: Optional[doctor.Machine] = None) -> RunConfig:
    """Parse, read the DeepSpeed config, apply the overrides and check everything that can be
    checked without starting a process group: errors say what to change. The run has
    `world_size` processes (default: WORLD_SIZE, else 1), on `machine` (default: this one)."""
    args = parser().parse_args(argv)
    check_flags(args)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    layout = process_layout(args, world_size)
    ds_config = read_ds_config(args.ds_config)
    dtype = doctor.precision(ds_config)
    machine = machine or doctor.probe()
    for finding in doctor.all_findings(machine, args.ds_config, processes_on_this_node(),
                                       ds_config=ds_config):
        if finding.fatal:
            fail(finding.text)
    if args.zero_stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    check_pipeline(args, ds_config, dtype)
    set_batch(args, ds_config, layout.dp)
    set_schedule(args, ds_config)
    resharding = plan_resume(args, layout, ds_config)
    if resharding is not None and resharding.convert:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    vocab_size = resharding.saved.vocab_size if resharding else padded_vocab(args.data, args.tp)
    ds_config["tensorboard"] = {"enabled": True, "job_name": "deepspeed",
                                "output_path": os.path.join(args.out, "tensorboard")}
    ds_config.setdefault("steps_per_print", 10**9)
    return RunConfig(objective=args.objective, model=args.model, data=args.data, out=args.out,
                     steps=args.steps, seq_len=args.seq_len, seed=args.seed,
                     eval_samples=args.eval_samples, keep_checkpoints=args.keep_checkpoints,
                     resume=args.resume == "auto", check_only=args.check_only, layout=layout,
                     intervals=Intervals(log=args.log_interval, eval=args.eval_interval,
                                         save=args.save_interval, image=args.image_interval),
                     models=model_configs(args, dtype, vocab_size), ds_config=ds_config,
                     ds_config_path=args.ds_config, index_cache=index_cache(args),
                     prefetch=args.prefetch, vectorised_stream=args.data_stream == "vectorised",
                     resharding=resharding)


def index_cache(args: argparse.Namespace) -> str:
    """--index-cache, else --data where this process may write, else OUT/index-cache; created,
    and checked writable."""
    folder = args.index_cache or (args.data if os.access(args.data, os.W_OK)
                                  else os.path.join(args.out, "index-cache"))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        fail(f"--index-cache {folder}: cannot create it ({error.strerror}); choose another "
             "folder with --index-cache")
    if not os.access(folder, os.W_OK):
        fail(f"--index-cache {folder}: not writable; choose another folder with --index-cache")
    return folder


def check_flags(args: argparse.Namespace) -> None:
    """Counts are positive, and --data holds what tupe-prep writes."""
    for name in ("steps", "seq_len", "tp", "pp", "eval_interval", "save_interval", "log_interval",
                 "image_interval", "keep_checkpoints", "eval_samples"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefetch < 0:
        fail("--prefetch must be 0 (no thread) or more")
    for name in ("train.idx", "valid.idx", "tokenizer.json"):
        if not os.path.exists(os.path.join(args.data, name)):
            fail(f"--data {args.data}: no {name}; run tupe-prep --output {args.data} first")
    if args.objective == "electra" and args.model not in PAIRS:
        fail(f"--objective electra needs --model {' or '.join(PAIRS)}, not {args.model!r}")
    if args.objective == "mlm" and args.model not in PRESETS:
        fail(f"--model {args.model!r} is an ELECTRA pair: add --objective electra")
    if args.pp > 1 and args.objective != "mlm":
        fail(f"--pp {args.pp}: pipeline parallelism is for BERT (--objective mlm); train "
             f"--objective {args.objective} with --tp and data parallelism")


def process_layout(args: argparse.Namespace, world_size: int) -> Layout:
    model_parallel = args.tp * args.pp
    if world_size % model_parallel:
        layout = f"--tp {args.tp}"
        if args.pp > 1:
            layout += f" x --pp {args.pp} = {model_parallel}"
        fail(f"{layout} does not divide the {world_size} processes")
    return Layout(world_size=world_size, tp=args.tp, pp=args.pp)


def read_ds_config(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        fail(f"--ds-config {path}: no such file")
    except json.JSONDecodeError as error:
        fail(f"--ds-config {path}: invalid JSON at line {error.lineno}: {error.msg}")


def check_pipeline(args: argparse.Namespace, ds_config: dict, dtype: str) -> None:
    """What DeepSpeed's pipeline engine cannot do with this ZeRO stage and precision."""
    if args.pp == 1:
        return
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if zero_stage > 1:
        source = "--zero-stage" if args.zero_stage is not None else args.ds_config
        fail(f"--pp {args.pp}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, and "
             f"{source} sets stage {zero_stage}; use --zero-stage 1")
    if zero_stage == 0 and dtype == "fp32" and ds_config.get("gradient_clipping", 1.0) > 0:
        # DeepSpeed's default gradient_clipping is 1.0.
        fail(f"--pp {args.pp} with ZeRO stage 0 in fp32: DeepSpeed's fp32 gradient clipping "
             "leaves the later stages' replicated parameters out of the gradient norm; use "
             "--zero-stage 1 (or fp16/bf16, or gradient_clipping 0)")


def set_batch(args: argparse.Namespace, ds_config: dict, dp: int) -> None:
    """Global batch, micro-batch and the gradient accumulation that joins them over dp ranks."""
    if args.micro_batch is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.global_batch is not None:
        ds_config["train_batch_size"] = args.global_batch
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    batch = ds_config.get("train_batch_size")
    if micro is None or batch is None:
        fail(f"{args.ds_config}: set train_batch_size and train_micro_batch_size_per_gpu "
             "(or --global-batch and --micro-batch)")
    if args.micro_batch is None and batch % dp == 0 and batch // dp < micro:
        # A config's micro-batch is the most one rank runs at once: with more data-parallel ranks
        # than that many fill the global batch, each runs its share in one micro-batch.
        micro = ds_config["train_micro_batch_size_per_gpu"] = batch // dp
    if batch % (micro * dp):
        fail(f"global batch {batch} is not a multiple of micro-batch {micro} x {dp} data-parallel "
             "ranks; change --global-batch or --micro-batch")
    ds_config["gradient_accumulation_steps"] = batch // (micro * dp)


def set_schedule(args: argparse.Namespace, ds_config: dict) -> None:
    """Learning rate and warmup overrides; the linear decay ends at --steps."""
    scheduler = ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in scheduler:
        scheduler["total_num_steps"] = args.steps
    if args.warmup_steps is not None:
        scheduler["warmup_num_steps"] = args.warmup_steps
    if args.lr is not None:
        ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if "warmup_max_lr" in scheduler:
            scheduler["warmup_max_lr"] = args.lr
    if scheduler.get("warmup_num_steps", 0) > args.steps:
        scheduler["warmup_num_steps"] = args.steps


def plan_resume(args: argparse.Namespace, layout: Layout,
                ds_config: dict) -> Optional[reshard.Reshard]:
    """How the latest checkpoint in --out resumes when it was written by another layout (None:
    as it is); one that cannot be reshaped stops the run here, before any process starts."""
    if args.resume != "auto":
        return None
    checkpoints = os.path.join(args.out, "checkpoints")
    tag = latest_tag(checkpoints)
    try:
        saved = reshard.read_saved_layout(checkpoints, tag) if tag else None
        if saved is None:
            return None
        return reshard.plan(tag, saved, layout.world_size, layout.tp, layout.pp,
                            ds_config.get("zero_optimization", {}).get("stage", 0),
                            reshard.has_zero_shards(os.path.join(checkpoints, tag)))
    except ValueError as error:
        fail(f"--out {args.out}: {error}")


def model_configs(args: argparse.Namespace, dtype: str, vocab_size: int) -> tuple:
    """(ModelConfig,) for mlm; (discriminator, generator) for electra."""
    presets = PAIRS[args.model] if args.objective == "electra" else (args.model,)
    positions = max(args.seq_len,
                    *(PRESETS[p].get("max_position_embeddings", 512) for p in presets))
    try:
        models = tuple(ModelConfig.from_preset(
            preset, pos_encoding=args.pos_encoding, tensor_parallel_size=args.tp,
            vocab_size=vocab_size, seq_length=args.seq_len,
            max_position_embeddings=positions, hidden_dropout=args.dropout,
            attention_dropout=args.dropout, dtype=dtype) for preset in presets)
    except ValueError as error:
        fail(str(error))
    if args.pp > models[0].num_layers:
        fail(f"--pp {args.pp}: --model {args.model} has {models[0].num_layers} layers, and every "
             "pipeline stage needs at least one; lower --pp")
    return models


def padded_vocab(data_dir: str, tp: int) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of 128 x tp (as Megatron pads it)."""
    size = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json")).get_vocab_size()
    multiple = 128 * tp
    return -(-size // multiple) * multiple

