"""Training step time of the positional encodings, next to Hugging Face's BertForMaskedLM.

    make bench        # or: DS_ACCELERATOR=cpu .venv/bin/python bench/step_time.py

(on a GPU machine leave DS_ACCELERATOR unset). One step = forward + loss + backward + AdamW step +
zero_grad, on the same random batch for every model (tupe_ds's models as its training step calls
them: no mask when nothing is padded, the masked-LM head on the labelled tokens only; `--attention
dense` for the reference attention layout). The models take turns, one timed step each
per round (the first model rotates), so that noise from the machine falls on all of them alike.
Prints the median and min ms/step, the ratio to bert-a and the ratio HF / ours; informational only.

tupe_ds's rows divide the loss per token as training does (tupe_ds/train/normalization.py: the
step's count of masked tokens, all-reduced, as the denominator); `--normalization-pair ENCODING`
adds a row "ENCODING micro-batch" that divides by each micro-batch's own count (the path
before), so that the cost of per-token normalisation is measured in the same run.
"""

import tupe_ds.tools.third_party_warnings  # noqa: F401  (first: filters import warnings)
import argparse
import os
import platform
import statistics
import time

import torch
from deepspeed.accelerator import get_accelerator
from transformers import BertConfig
from transformers import BertForMaskedLM as HFBertForMaskedLM

import tupe_ds
from tupe_ds.model.config import ATTENTION, DTYPES
from tupe_ds.model.layers import labelled_positions
from tupe_ds.train.normalization import MICRO_BATCH, PER_TOKEN, LossNormalization
from tupe_ds.train.objectives import OBJECTIVES

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--ffn", type=int, default=1024)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--vocab", type=int, default=32768)
parser.add_argument("--steps", type=int, default=20, help="timed steps per model")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
parser.add_argument("--encodings", default="tupe-a,tupe-r,bert-a,bert-r",
                    help="comma-separated tupe_ds encodings; HF's BERT is always added")
parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                    help="dtype of parameters and activations of every model (no autocast)")
parser.add_argument("--attention", choices=list(ATTENTION), default="fast",
                    help="how tupe_ds models hand the positional term to the attention kernel")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--normalization-pair", default="tupe-r", metavar="ENCODING",
                    help="also time ENCODING with --loss-normalization micro-batch ('' for none)")
args = parser.parse_args()

accelerator = get_accelerator()
device = torch.device(accelerator.current_device_name())
dtype = DTYPES[args.dtype]
HF = "hf-bert (sdpa)"


def device_name() -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    return platform.processor() or platform.machine()


# ---- models: same size, same seed --------------------------------------------------------------
def build_ours(encoding: str) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return tupe_ds.build_model(
        "tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, vocab_size=args.vocab, max_position_embeddings=max(512, args.seq),
        seq_length=args.seq, pos_encoding=encoding, hidden_dropout=0.1, attention_dropout=0.1,
        dtype=args.dtype, attention=args.attention,
    )


def build_hf() -> torch.nn.Module:
    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.ffn, hidden_act="gelu",
        max_position_embeddings=max(512, args.seq), hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, layer_norm_eps=1e-5, attn_implementation="sdpa",
    )
    return HFBertForMaskedLM(config).to(device=device, dtype=dtype)  # built from config: no download


MICRO_BATCH_ROW = f"{args.normalization_pair} {MICRO_BATCH}"
models = {name: build_ours(name) for name in args.encodings.split(",")}
if args.normalization_pair:
    models[MICRO_BATCH_ROW] = build_ours(args.normalization_pair)
normalizations = {name: LossNormalization(MICRO_BATCH if name == MICRO_BATCH_ROW else PER_TOKEN,
                                          OBJECTIVES["mlm"], device) for name in models}
models[HF] = build_hf()
optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
for m in models.values():
    m.train()

# ---- one batch for everyone: full-length sequences, ~15% of positions labelled -----------------
g = torch.Generator().manual_seed(args.seed)
input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
attention_mask = torch.ones(args.batch, args.seq, dtype=torch.long)
labelled = torch.rand(args.batch, args.seq, generator=g) < 0.15
labels = input_ids.masked_fill(~labelled, -100)
positions = labelled_positions(labels)  # taken on the host, as tupe_ds's training step does
host_batch = {"labels": labels}  # where the training step counts the masked tokens
input_ids, attention_mask, labels, positions = (
    t.to(device) for t in (input_ids, attention_mask, labels, positions))


def train_step(name: str) -> None:
    model, optimizer = models[name], optimizers[name]
    if name == HF:
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    else:  # as tupe_ds's training step: no mask without padding, the head on labelled tokens
        denominators, _ = normalizations[name].divisors([host_batch], per_token=False)
        loss, _ = model(input_ids, None, labels, positions,
                        None if denominators is None else denominators[0])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_step(name: str) -> float:
    accelerator.synchronize()
    t0 = time.perf_counter()
    train_step(name)
    accelerator.synchronize()
    return (time.perf_counter() - t0) * 1000.0


# ---- measure: round-robin, the first model rotating each round --------------------------------
names = list(models)
times = {name: [] for name in names}
for r in range(args.warmup + args.steps):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        ms = timed_step(name)
        if r >= args.warmup:
            times[name].append(ms)

# ---- report --------------------------------------------------------------------------------------
print(f"machine: {device_name()}; device {device} ({accelerator.device_name()}); "
      f"torch {torch.__version__}, {torch.get_num_threads()} threads")
print(f"size: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, "
      f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
      f"{args.attention} attention; "
      f"{args.steps} timed steps after {args.warmup} warm-up, interleaved")
median = {name: statistics.median(t) for name, t in times.items()}
base = median.get("bert-a")
print(f"\n{'model':<20}{'params':>9}{'median ms':>11}{'min ms':>9}{'x bert-a':>10}{'HF / this':>11}")
for name in names:
    params = sum(p.numel() for p in models[name].parameters()) / 1e6
    ratio = f"{median[name] / base:.3f}" if base else "-"
    print(f"{name:<20}{params:>8.2f}M{median[name]:>11.1f}{min(times[name]):>9.1f}"
          f"{ratio:>10}{median[HF] / median[name]:>11.3f}")
if base and "tupe-r" in median:
    ratio = median["tupe-r"] / base
    print(f"\ntupe-r / bert-a = {ratio:.3f}")
    print(f"target: tupe-r <= 1.05x bert-a: {'PASS' if ratio <= 1.05 else 'FAIL'}")
if args.normalization_pair:
    per_token = normalizations[args.normalization_pair]
    accelerator.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):  # what per-token adds to a step: count, copy, all-reduce, divide
        per_token.divisors([host_batch], per_token=False)
    accelerator.synchronize()
    added_ms = time.perf_counter() - t0  # 1000 calls: seconds = ms per call
    print(f"\nper-token denominators alone: {added_ms * 1000:.0f} us per step, "
          f"{added_ms / median[args.normalization_pair]:.3%} of {args.normalization_pair}'s median")
    ratio = median[args.normalization_pair] / median[MICRO_BATCH_ROW]
    print(f"{args.normalization_pair}: per-token / micro-batch = {ratio:.3f} by median, "
          f"{min(times[args.normalization_pair]) / min(times[MICRO_BATCH_ROW]):.3f} by min")
    print(f"target: per-token <= 1.01x micro-batch: {'PASS' if ratio <= 1.01 else 'FAIL'}")
