"""Attention alone, per positional encoding and layout: forward + backward of the positional
module and of every layer's core attention, on BERT-Large shapes by default.

    python bench/attention.py                                   # on a GPU: BERT-Large, seq 512
    DS_ACCELERATOR=cpu python bench/attention.py --layers 2 --hidden 256 --heads 4 --seq 128 --batch 4
    python bench/attention.py --head-multiples 8,64,128          # widened heads padded to each

What one measurement is: the AttentionBias of a batch built once (as the encoder does), then the
core attention of `--layers` layers on random q, k, v [n, b, heads, d_head] (megatron-core's
layout, the same for every encoding), then the backward of the sum of their outputs. Layouts:
`dense` (the reference: one additive mask) and `fast` (tupe_ds's default; model/positional.py),
the latter once per `--head-multiples` value for the encodings whose q/k heads it widens (with
the value given, TUPE-A's term goes into q/k columns on any device, as on CUDA).
Every variant takes turns, one timed call each per round, so noise falls on all alike. Prints the
median ms and the ratio to bert-a's fast layout. Informational; the exit code is 0.
"""

import argparse
import statistics
import time
from unittest import mock

import torch
from deepspeed.accelerator import get_accelerator

import tupe_ds
from tupe_ds.model import positional
from tupe_ds.model.config import DTYPES

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--layers", type=int, default=24)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--encodings", default="bert-a,tupe-a,tupe-r,bert-r")
parser.add_argument("--padded", action="store_true",
                    help="samples of random length in [seq/2, seq] rather than none padded")
parser.add_argument("--head-multiples", default="",
                    help="comma-separated multiples to pad widened heads to (default: the "
                         "device's choice, positional.fast_head_multiple)")
parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default: bf16 on CUDA, fp32 elsewhere")
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
args = parser.parse_args()

accelerator = get_accelerator()
device = torch.device(accelerator.current_device_name())
dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
n, b, heads, d = args.seq, args.batch, args.heads, args.hidden // args.heads


def build(encoding: str, attention: str):
    torch.manual_seed(0)
    model = tupe_ds.build_model(
        "tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
        ffn_hidden_size=64, vocab_size=128, max_position_embeddings=max(512, n), seq_length=n,
        pos_encoding=encoding, attention=attention, attention_dropout=args.dropout,
        dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    layers = [layer.self_attention.core_attention for layer in model.encoder.block.layers]
    return model.encoder.positional, layers


generator = torch.Generator().manual_seed(1)
qkv = [torch.randn(n, b, heads, d, generator=generator).to(device, dtype).requires_grad_()
       for _ in range(3)]
padding = None
if args.padded:
    lengths = torch.randint(n // 2, n + 1, (b,), generator=generator)
    padding = (torch.arange(n)[None, :] >= lengths[:, None]).to(device)


def variants():
    """name -> (positional module, core attentions, head multiple or None)."""
    multiples = [int(m) for m in args.head_multiples.split(",") if m]
    out = {}
    for encoding in args.encodings.split(","):
        out[f"{encoding} dense"] = (*build(encoding, "dense"), None)
        widened = tupe_ds.ENCODINGS[encoding].untied and not tupe_ds.ENCODINGS[encoding].relative
        widened = widened or (padding is not None and tupe_ds.ENCODINGS[encoding].relative)
        for multiple in (multiples if widened and multiples else [None]):
            name = f"{encoding} fast" + (f" x{multiple}" if multiple else "")
            out[name] = (*build(encoding, "fast"), multiple)
    return out


def call(positional_module, layers, multiple) -> float:
    """One forward + backward; with a head multiple, TUPE-A's columns padded to it (as on CUDA)."""
    choose = (lambda device, masked: multiple) if multiple else positional.fast_head_multiple
    columns = (lambda device: True) if multiple else positional.untied_as_columns
    accelerator.synchronize()
    start = time.perf_counter()
    with mock.patch.object(positional, "fast_head_multiple", choose), \
            mock.patch.object(positional, "untied_as_columns", columns):
        bias = positional_module.attention_bias(n, padding, dtype, device)
        total = sum(layer(*qkv, attention_bias=bias).float().sum() for layer in layers)
    total.backward()
    accelerator.synchronize()
    return (time.perf_counter() - start) * 1000


runs = variants()
times = {name: [] for name in runs}
names = list(runs)
for r in range(args.warmup + args.steps):
    for name in names[r % len(names):] + names[:r % len(names)]:
        ms = call(*runs[name])
        if r >= args.warmup:
            times[name].append(ms)

print(f"device {device} ({accelerator.device_name()}), torch {torch.__version__}; {args.layers} "
      f"layers, batch {b}, seq {n}, {heads} heads of {d}, {dtype}, dropout {args.dropout}, "
      f"{'padded' if args.padded else 'no padding'}; {args.steps} timed after {args.warmup}")
base = statistics.median(times["bert-a fast"]) if "bert-a fast" in times else None
print(f"{'layout':<24}{'median ms':>10}{'per layer':>10}{'x bert-a':>10}")
for name, values in times.items():
    median = statistics.median(values)
    ratio = f"{median / base:.3f}" if base else "-"
    print(f"{name:<24}{median:>10.2f}{median / args.layers:>10.3f}{ratio:>10}")
