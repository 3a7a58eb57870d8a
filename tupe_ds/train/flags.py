"""tupe-pretrain's command line: the parser, the checks each flag needs on its own (counts, flags
that need another, the model for the objective), and `fail`, which refuses it (Refused:
tools/errors.py). The masking's shares: masking_flags.py; the --data folders and their
--index-cache: data_folders.py."""

import argparse
import math

from tupe_ds.data.masking import BERT_MASKING, ELECTRA_MASKING
from tupe_ds.model.config import COMPILE, ENCODINGS, PRESETS
from tupe_ds.model.electra import PAIRS
from tupe_ds.tools import command_line
from tupe_ds.tools.errors import Refused
from tupe_ds.tools.third_party_warnings import add_verbose_flag
from tupe_ds.train import normalization, optimizer_boundary
from tupe_ds.train.masking_flags import mask_rate, mask_split
from tupe_ds.train.schedule import DECAY_SHAPES, SCHEDULES

SHAPE_FLAGS = {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
               "--num-attention-heads": "num_attention_heads",
               "--ffn-hidden-size": "ffn_hidden_size"}  # flag: its ModelConfig field
MICRO_BATCH_AUTO = "auto"  # of --micro-batch and the config's micro-batch: train/micro_batch.py
DATA_STREAMS = {
    "vectorised": "each micro-batch read and masked in whole-batch operations",
    "per-sample": "the reference: sample by sample (the same batches, slower)",
}


# Megatron-LM's names whose meaning differs from any tupe-pretrain flag: refused, saying what
# to give (docs/pretraining.md, "Names from Megatron-LM and DeepSpeed").
NOT_OURS = {
    "--fp16": "the --ds-config sets the precision: ds_configs/*_fp16.json train in fp16 (--bf16 "
              "trains any of them in bf16)",
    "--min-lr": "the --ds-config's scheduler sets the minimum (warmup_min_lr; WarmupCosineLR's "
                "cos_min_ratio)",
    "--clip-grad": "the --ds-config's gradient_clipping sets it",
    "--weight-decay": "the --ds-config's optimizer params set it (weight_decay)",
    "--save": "one --out holds the checkpoints (OUT/checkpoints), TensorBoard and the log",
    "--load": "one --out holds the checkpoints and a run resumes from it (--init-from starts a new "
              "run from another run's)",
    "--eval-iters": "give --eval-samples, valid samples per validation (iterations times the "
                    "global batch)",
    "--hidden-dropout": "--dropout sets the hidden and the attention dropout together",
    "--attention-dropout": "--dropout sets the hidden and the attention dropout together",
    "--tensorboard-dir": "TensorBoard's events go to OUT/tensorboard",
    "--lr-decay-iters": "the schedule decays to the minimum at --steps (--lr-schedule wsd: over "
                        "the last --decay-steps)",
    "--train-samples": "give --steps, optimizer steps (samples divided by the global batch)",
}


def parser() -> argparse.ArgumentParser:
    p = command_line.Parser(
        prog="tupe-pretrain", allow_abbrev=False,  # tupe-compare's recipes read the flags
        description="Masked-LM pretraining with DeepSpeed. Start it with `deepspeed --num_gpus N "
                    "--module tupe_ds.pretrain ...` or `torchrun --nproc_per_node N -m "
                    "tupe_ds.pretrain ...`.")
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    p.add_argument("--data", "--data-path", required=True, nargs="+",
                   metavar="FOLDER | W1 FOLDER1 W2 ...",
                   help="a folder written by tupe-prep, or a blend of several with their "
                        "weights (token counts too): --data 0.7 wiki 0.3 books (same "
                        "tokenizer); NAME=FOLDER names a source's metrics (default: the "
                        "folder's name, or its parent's for a .../NAME/merged)")
    p.add_argument("--objective", default="mlm", choices=["mlm", "electra"],
                   help="mlm: BERT masked LM; electra: generator + discriminator")
    p.add_argument("--model", default="bert-base", choices=sorted(set(PRESETS) | set(PAIRS)),
                   help="a preset; with --objective electra a pair: electra-base or tiny")
    p.add_argument("--pos-encoding", default="tupe-r", choices=list(ENCODINGS))
    shape = p.add_argument_group(
        "model shape", "the --model preset's, changed (BERT, --objective mlm; Megatron-LM's names)")
    for flag, field in SHAPE_FLAGS.items():
        shape.add_argument(flag, type=int, metavar="N", help=f"the preset's {field}")
    p.add_argument("--ds-config", "--deepspeed_config", "--deepspeed-config", required=True,
                   help="DeepSpeed JSON config (ds_configs/)")
    p.add_argument("--bf16", action="store_true",
                   help="train the --ds-config in bf16 in place of its precision (GPUs of compute "
                        "capability 8.0 or newer: A100, H100, H200): no loss scaling, so no step "
                        "skipped for overflow")
    p.add_argument("--out", required=True, help="run folder: checkpoints/, tensorboard/, log")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel size")
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (BERT, --objective mlm; ZeRO stage 0 or 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                   help="overrides zero_optimization.stage")
    p.add_argument("--steps", "--train-iters", type=int, required=True,
                   help="total optimizer steps of the run; a larger value resumes and goes on")
    p.add_argument("--seq-len", "--seq-length", type=int, default=512)
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
    p.add_argument("--loss-normalization", choices=list(normalization.MODES),
                   default=normalization.PER_TOKEN,
                   help="per-token: a step's loss is its summed token losses over the global "
                        "count of counted tokens, whatever the split into micro-batches and "
                        "ranks; micro-batch: the mean of each micro-batch's mean, as BERT's and "
                        "ELECTRA's original code (tupe_ds/train/normalization.py)")
    p.add_argument("--mask-rate", type=mask_rate, metavar="P",
                   help="the share of each sample's tokens ([CLS], [SEP] and padding never) "
                        "chosen for the masked-LM loss, above 0 and below 1 (default "
                        f"{BERT_MASKING.probability:g}; for ELECTRA, its generator's)")
    p.add_argument("--mask-split", type=mask_split, metavar="M,R",
                   help="the shares of the chosen tokens made [MASK] and made a random token; "
                        "the rest stay as they were (default: BERT "
                        f"{BERT_MASKING.mask:g},{BERT_MASKING.random:g}, ELECTRA's generator "
                        f"{ELECTRA_MASKING.mask:g},{ELECTRA_MASKING.random:g})")
    p.add_argument("--micro-batch", "--micro-batch-size", type=micro_batch, metavar="N | auto",
                   help="overrides train_micro_batch_size_per_gpu; auto: the largest divisor of "
                        "each rank's share of the global batch that fits in memory, probed at the "
                        "start and kept in OUT/run.json for the run's resumes on the same layout "
                        "(train/micro_batch.py)")
    p.add_argument("--global-batch", "--global-batch-size", type=int,
                   help="overrides train_batch_size")
    p.add_argument("--lr", type=float, help="overrides the peak learning rate")
    p.add_argument("--warmup-steps", "--lr-warmup-iters", type=int,
                   help="overrides the scheduler's warmup_num_steps")
    p.add_argument("--lr-schedule", "--lr-decay-style", type=str.lower, choices=list(SCHEDULES),
                   help="the learning rate's shape, with the config's peak, minimum and warmup "
                        "(default: the --ds-config's scheduler, linear in every shipped one); "
                        + "; ".join(f"{name}: {text}" for name, text in SCHEDULES.items()))
    p.add_argument("--decay-steps", "--lr-wsd-decay-iters", type=int, metavar="N",
                   help="--lr-schedule wsd: the last N steps of --steps decay to the minimum")
    p.add_argument("--decay-shape", choices=DECAY_SHAPES,
                   help="--lr-schedule wsd: the decay's shape (default linear; 1-sqrt: Hägele "
                        "et al. 2024's, ModernBERT's)")
    p.add_argument("--rampup-batch-size", type=int, nargs=3,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron-LM's batch ramp: the global batch starts at START and grows "
                        "by INCREMENT up to --global-batch (or the config's), evenly over the "
                        "first SAMPLES samples; START and INCREMENT are multiples of micro-batch "
                        "x data-parallel ranks. --steps and the schedule count optimizer steps")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--compile", choices=list(COMPILE),
                   help="what torch.compile takes as one region (default: on CUDA the whole "
                        "block at --tp 1 outside ZeRO stage 3, else none); "
                        + "; ".join(f"{name}: {text}" for name, text in COMPILE.items()))
    p.add_argument("--eval-interval", type=int, default=1000, help="steps between validations")
    p.add_argument("--eval-samples", type=int, default=256, help="valid samples per validation")
    p.add_argument("--save-interval", type=int, default=1000, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=3,
                   help="complete checkpoints of this run kept (older ones are removed after "
                        "each save; nothing else is ever deleted)")
    p.add_argument("--log-interval", type=int, default=10, help="steps between log lines")
    p.add_argument("--image-interval", type=int, default=1000,
                   help="steps between images of the positional logits in TensorBoard")
    p.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from the newest complete checkpoint in --out (verified; "
                        "the previous one if it does not verify); never: refuse to start when "
                        "--out holds checkpoints")
    p.add_argument("--resume-from", metavar="stepN",
                   help="resume from this checkpoint of --out: stepN, or its path (newer ones "
                        "are set aside); once: a later attempt of the same command (a requeued "
                        "job) resumes the newest checkpoint the run wrote since")
    p.add_argument("--fresh-start", action="store_true",
                   help="when --out holds checkpoints of which none can be resumed (damaged, or "
                        "failing verification), start from step 0 and set them aside in "
                        "OUT/checkpoints/set-aside/, deleting nothing; without it such a run is "
                        "refused. A checkpoint that can be resumed still is")
    p.add_argument("--giving-up", metavar="ID",
                   help="with --resume-from or --fresh-start: the id of the run's newest "
                        "checkpoint (the line that suggests it prints it), which the flag gives up "
                        "with every checkpoint after the one it resumes. Each flag applies once, "
                        "to the state it is first given on: repeated by a requeued job's script, "
                        "it is spent; with --giving-up it applies to the state that id names")
    p.add_argument("--allow-training-changes", action="store_true",
                   help="resume even though the optimizer or schedule settings (--lr, "
                        "--warmup-steps, the config's optimizer, scheduler, gradient clipping) "
                        "differ from the checkpoint's; the run says each change")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="start a new run from another run's weights (RUN_DIR, RUN_DIR/"
                        "checkpoints or .../stepN) with this run's schedule and data stream: "
                        "BERT's phase 2 at seq 512 from phase 1 at 128; ignored once --out "
                        "holds a checkpoint of its own")
    p.add_argument("--init-optimizer", action="store_true",
                   help="with --init-from: also Adam's moments and step (same layout)")
    p.add_argument("--branch", action="store_true",
                   help="with --init-from: continue that run in this --out from its checkpoint's "
                        "step and data position, with its optimizer state and random streams, "
                        "under this command's schedule (a decay branch of a stable WSD run: "
                        "--lr-schedule wsd --decay-steps N --steps STEP+N; same layout, same "
                        "data and model)")
    p.add_argument("--optimizer-boundary", choices=list(optimizer_boundary.BOUNDARIES),
                   default=optimizer_boundary.DEFAULT,
                   help="; ".join(f"{name}: {text}"
                                  for name, text in optimizer_boundary.BOUNDARIES.items()))
    p.add_argument("--max-nonfinite-steps", type=int, default=3,
                   help="stop after this many steps in a row whose loss or gradient is not "
                        "finite (none of them is applied)")
    p.add_argument("--check-only", action="store_true",
                   help="check the command, data and DeepSpeed config for WORLD_SIZE processes, "
                        "then exit (what slurm/pretrain.sbatch does before starting the tasks)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's
    p.not_ours = NOT_OURS
    command_line.paths(p, "ds_config", "out", "index_cache", "init_from", blend=["data"])
    return p


def micro_batch(text: str):
    """--micro-batch: a count of samples, or MICRO_BATCH_AUTO."""
    if text == MICRO_BATCH_AUTO:
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a count of samples (at least 1) or "
                                         f"{MICRO_BATCH_AUTO}")
    return count


def fail(message: str):
    """Refuses the command with `message`, which says what to change."""
    raise Refused(message)


def check_flags(args: argparse.Namespace) -> None:
    """Counts are positive, flags that need another are given it, and the model fits the
    objective."""
    for name in ("steps", "seq_len", "tp", "pp", "eval_interval", "save_interval", "log_interval",
                 "image_interval", "keep_checkpoints", "eval_samples", "max_nonfinite_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.lr is not None and not 0 < args.lr < math.inf:  # nan compares false
        fail(f"--lr {args.lr}: a learning rate is a positive, finite number (such as 1e-4)")
    if not 0 <= args.dropout < 1:
        fail(f"--dropout {args.dropout}: a probability from 0 to below 1")
    if not 0 <= args.seed < 2**63:
        fail(f"--seed {args.seed}: give a whole number from 0 to 2**63-1")
    if args.resume_from and args.resume == "never":
        fail("--resume-from with --resume never: choose one")
    if args.giving_up and not (args.resume_from or args.fresh_start):
        fail("--giving-up names what --resume-from or --fresh-start gives up: give one of them")
    if args.resume_from and args.fresh_start:
        fail("--resume-from with --fresh-start: choose one (--resume-from never starts from "
             "step 0)")
    if args.init_optimizer and not args.init_from:
        fail("--init-optimizer needs --init-from CHECKPOINT")
    if args.branch and not args.init_from:
        fail("--branch needs --init-from CHECKPOINT (the stable run's checkpoint to decay from)")
    if args.warmup_steps is not None and args.warmup_steps < 1:
        fail("--warmup-steps must be at least 1 (DeepSpeed's schedulers warm up over at least "
             "one step)")
    if args.lr_schedule == "wsd" and args.decay_steps is None:
        fail("--lr-schedule wsd needs --decay-steps N: the last N steps of --steps decay (10-20% "
             "of the run in ModernBERT's and Hägele et al.'s recipes)")
    if args.decay_steps is not None and args.lr_schedule != "wsd":
        fail("--decay-steps is --lr-schedule wsd's: add --lr-schedule wsd")
    if args.decay_shape is not None and args.lr_schedule != "wsd":
        fail("--decay-shape is --lr-schedule wsd's: add --lr-schedule wsd --decay-steps N")
    if args.decay_steps is not None and args.decay_steps < 1:
        fail("--decay-steps must be at least 1")
    if args.rampup_batch_size is not None:
        start, increment, samples = args.rampup_batch_size
        if min(start, increment, samples) < 1:
            fail(f"--rampup-batch-size {start} {increment} {samples}: START, INCREMENT and "
                 "SAMPLES must each be at least 1")
    if args.prefetch < 0:
        fail("--prefetch must be 0 (no thread) or more")
    if args.objective == "electra" and args.model not in PAIRS:
        fail(f"--objective electra needs --model {' or '.join(PAIRS)}, not {args.model!r}")
    if args.objective == "mlm" and args.model not in PRESETS:
        fail(f"--model {args.model!r} is an ELECTRA pair: add --objective electra")
    shape = [flag for flag, field in SHAPE_FLAGS.items() if getattr(args, field) is not None]
    if shape and args.objective != "mlm":
        fail(f"{', '.join(shape)}: the model shape flags change a BERT preset (--objective mlm); "
             f"ELECTRA's generator and discriminator are the --model pair's")
    for flag in shape:
        if getattr(args, SHAPE_FLAGS[flag]) < 1:
            fail(f"{flag} must be at least 1")
    if args.pp > 1 and args.objective != "mlm":
        fail(f"--pp {args.pp}: pipeline parallelism is for BERT (--objective mlm); train "
             f"--objective {args.objective} with --tp and data parallelism")
