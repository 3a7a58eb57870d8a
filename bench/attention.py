"""Attention alone, per positional encoding and kernel layout: forward + backward of the positional
module and of every layer's core attention, on BERT-Large shapes on CUDA (a tiny size elsewhere).

    python bench/attention.py [--json build/bench-attention.json]   # on a GPU: BERT-Large, seq 512
    DS_ACCELERATOR=cpu python bench/attention.py --hidden 256 --seq 128   # CPU (default: tiny)
    python bench/attention.py --head-multiples 8,64,128 --padding real

What one measurement is: the kernel layout of a batch built once (as the encoder does), then the
core attention of `--layers` layers on random q, k, v [n, b, heads, d_head] (megatron-core's
layout, the same for every candidate), then the backward of the sum of their outputs. Batches:
`real` padding (each sample's length drawn from what the training loader gives,
bench/real_lengths.py; the default, first) and `none` (full length, no mask). Candidates, per
encoding and padding, each a ModelConfig: the dense reference; the fast layout with every
`key_padding` (auto, mask, column, unpadded; padded batches only), for TUPE-A both ways of its
positional term (`untied_as_columns` False: a mask, True: q/k columns), and where the q/k heads
that reach SDPA are wider than d_head, once per `--head-multiples` value (`head_multiple`; default
8 and 64 on CUDA, the device's choice elsewhere). Each row says what reached SDPA (q/k head size,
mask shape, or nested tensors). Candidates of one padding take turns, one timed call each per
round, so noise falls on all alike. Prints median ms and the ratio to bert-a's default fast
layout; informational, the exit code is 0.
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: bench.* from the repository's root

import tupe_ds.tools.third_party_warnings  # noqa: F401,E402  (first: filters import warnings)
import tupe_ds  # noqa: E402
from bench.gpu.markdown import table  # noqa: E402
from bench.real_lengths import padding_mask, real_lengths  # noqa: E402
from tupe_ds.model.config import DTYPES, KEY_PADDING  # noqa: E402

CUDA_SIZE = dict(layers=24, hidden=1024, heads=16, seq=512, batch=16, dtype="bf16",
                 head_multiples="8,64")
CPU_SIZE = dict(layers=2, hidden=64, heads=4, seq=64, batch=4, dtype="fp32", head_multiples="")
PADDINGS = ("real", "none")


@dataclass
class Candidate:
    """One way of running an encoding's attention: ModelConfig fields, its modules, what
    reached SDPA."""

    encoding: str
    attention: str = "dense"
    key_padding: str = "auto"
    untied_as_columns: Optional[bool] = None
    head_multiple: Optional[int] = None
    positional: Optional[torch.nn.Module] = None
    reaches_sdpa: str = ""
    widened: bool = False  # q/k heads wider than d_head reached SDPA

    @property
    def name(self) -> str:
        parts = [self.encoding, self.attention]
        if self.attention == "fast":
            parts.append(f"pad={self.key_padding}")
        if self.untied_as_columns is not None:
            parts.append("untied=" + ("columns" if self.untied_as_columns else "mask"))
        if self.head_multiple:
            parts.append(f"x{self.head_multiple}")
        return " ".join(parts)


class SdpaShapes(TorchFunctionMode):
    """Records what each scaled_dot_product_attention call is given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, _, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            what = ("nested " if q.is_nested else "") + f"q/k {q.shape[-1]}, v {v.shape[-1]}, "
            self.calls.append((q.shape[-1], what + (
                f"mask {list(mask.shape)}" if mask is not None else "no mask")))
        return func(*args, **kwargs)


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    size = CUDA_SIZE if get_accelerator().device_name() == "cuda" else CPU_SIZE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("layers", "hidden", "heads", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=size[name])
    p.add_argument("--encodings", default="bert-a,tupe-a,tupe-r,bert-r")
    p.add_argument("--padding", default="real,none",
                   help="comma-separated, a table part each: real (as the training loader pads), "
                        "none (full length)")
    p.add_argument("--head-multiples", default=size["head_multiples"],
                   help="comma-separated multiples to pad widened q/k heads to ('': the "
                        "device's choice only)")
    p.add_argument("--dtype", choices=list(DTYPES), default=size["dtype"])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the results here")
    settings = p.parse_args(argv)
    settings.encodings = [e for e in settings.encodings.split(",") if e]
    settings.padding = [x for x in settings.padding.split(",") if x]
    settings.head_multiples = [int(m) for m in settings.head_multiples.split(",") if m]
    if not settings.padding or set(settings.padding) - set(PADDINGS):
        p.error(f"--padding: one or more of {', '.join(PADDINGS)}")
    return settings


def get_device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def build(settings, candidate: Candidate, layers: int) -> tupe_ds.BertForMaskedLM:
    torch.manual_seed(0)
    return tupe_ds.build_model(
        "tiny", num_layers=layers, hidden_size=settings.hidden,
        num_attention_heads=settings.heads, ffn_hidden_size=64, vocab_size=128,
        max_position_embeddings=max(512, settings.seq), seq_length=settings.seq,
        pos_encoding=candidate.encoding, attention=candidate.attention,
        key_padding=candidate.key_padding, untied_as_columns=candidate.untied_as_columns,
        head_multiple=candidate.head_multiple, attention_dropout=settings.dropout,
        dtype=settings.dtype)


def core_attentions(settings, encoding: str) -> list:
    """Every layer's core attention of `encoding` (they hold no weights: the layout decides)."""
    model = build(settings, Candidate(encoding), settings.layers)
    return [layer.self_attention.core_attention for layer in model.encoder.block.layers]


def batch(settings, padded: bool):
    """q, k, v [n, b, heads, d_head] with gradients, and the padding [b, n] (True at padded
    positions; None when no sample is padded), as the encoder passes it."""
    device, dtype = get_device(), DTYPES[settings.dtype]
    g = torch.Generator().manual_seed(settings.seed)
    n, b, heads = settings.seq, settings.batch, settings.heads
    qkv = [torch.randn(n, b, heads, settings.hidden // heads, generator=g)
           .to(device, dtype).requires_grad_() for _ in range(3)]
    padding = None
    if padded:
        padding = padding_mask(real_lengths(n, b, g), n) == 0
        padding = padding.to(device) if padding.any() else None
    return qkv, padding


def call(settings, candidate: Candidate, layers: list, qkv: list, padding) -> float:
    """One forward + backward, ms."""
    synchronize = get_accelerator().synchronize
    synchronize()
    start = time.perf_counter()
    layout = candidate.positional.attention_bias(settings.seq, padding, DTYPES[settings.dtype],
                                                 get_device())
    total = sum(layer(*qkv, attention_bias=layout).float().sum() for layer in layers)
    total.backward()
    synchronize()
    return (time.perf_counter() - start) * 1000


def prepared(settings, candidate: Candidate, layers: list, qkv: list, padding) -> Candidate:
    """The candidate with its positional module and what reaches SDPA (one probing call)."""
    candidate.positional = build(settings, candidate, 1).encoder.positional
    with SdpaShapes() as shapes:
        call(settings, candidate, layers[:1], qkv, padding)
    candidate.reaches_sdpa = shapes.calls[0][1]
    candidate.widened = shapes.calls[0][0] > settings.hidden // settings.heads
    return candidate


def candidates(settings, encoding: str, layers: list, qkv: list, padding) -> list:
    """The dense reference and every fast candidate of one encoding for one batch."""
    out = [prepared(settings, Candidate(encoding), layers, qkv, padding)]
    enc = tupe_ds.ENCODINGS[encoding]
    untied_choices = [False, True] if enc.untied and not enc.relative else [None]
    for key_padding in KEY_PADDING if padding is not None else ["auto"]:
        for untied in untied_choices:
            fast = dict(encoding=encoding, attention="fast", key_padding=key_padding,
                        untied_as_columns=untied)
            probe = prepared(settings, Candidate(**fast), layers, qkv, padding)
            if not (probe.widened and settings.head_multiples):
                out.append(probe)
            for multiple in settings.head_multiples if probe.widened else []:
                out.append(prepared(settings, Candidate(**fast, head_multiple=multiple), layers,
                                    qkv, padding))
    return out


def time_in_turns(settings, runs: list) -> list:
    """Median ms of each (candidate, layers, qkv, padding), taking turns, one call per round."""
    times = [[] for _ in runs]
    for r in range(settings.warmup + settings.steps):
        for i in [(r + j) % len(runs) for j in range(len(runs))]:
            ms = call(settings, *runs[i])
            if r >= settings.warmup:
                times[i].append(ms)
    return [statistics.median(t) for t in times]


def measure_padding(settings, padding_name: str, layers: dict) -> list:
    qkv, padding = batch(settings, padding_name == "real")
    runs = [(candidate, layers[encoding], qkv, padding) for encoding in settings.encodings
            for candidate in candidates(settings, encoding, layers[encoding], qkv, padding)]
    medians = time_in_turns(settings, runs)
    rows = [{"name": c.name, "padding": padding_name, "encoding": c.encoding,
             "attention": c.attention, "key_padding": c.key_padding,
             "untied_as_columns": c.untied_as_columns, "head_multiple": c.head_multiple,
             "reaches_sdpa": c.reaches_sdpa, "median_ms": ms, "per_layer_ms": ms / settings.layers}
            for (c, *_), ms in zip(runs, medians)]
    base = next((r["median_ms"] for r in rows if r["name"] == "bert-a fast pad=auto"), None)
    for row in rows:
        row["x_bert_a"] = row["median_ms"] / base if base else None
    return rows


def head(settings) -> dict:
    """The result before any row: the setup and the flags."""
    device = get_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    setup = (f"{name} ({device}), torch {torch.__version__}; {settings.layers} layers, batch "
             f"{settings.batch}, seq {settings.seq}, {settings.heads} heads of "
             f"{settings.hidden // settings.heads}, {settings.dtype}, dropout {settings.dropout}; "
             f"median of {settings.steps} calls after {settings.warmup}")
    return {"setup": setup, "args": dict(vars(settings)), "rows": []}


def run(settings, on_rows=lambda rows: None) -> dict:
    """Every candidate, each --padding in turn; the JSON's content. `on_rows` is given each
    padding's rows as soon as they are timed."""
    result = head(settings)
    layers = {encoding: core_attentions(settings, encoding) for encoding in settings.encodings}
    for padding in settings.padding:
        rows = measure_padding(settings, padding, layers)
        on_rows(rows)
        result["rows"] += rows
    return result


def report(result: dict) -> str:
    lines = [result["setup"], ""] + table(
        ["candidate", "padding", "reaches SDPA", "median ms", "per layer", "x bert-a fast"],
        [[r["name"], r["padding"], r["reaches_sdpa"], f"{r['median_ms']:.2f}",
          f"{r['per_layer_ms']:.3f}", "-" if r["x_bert_a"] is None else f"{r['x_bert_a']:.3f}"]
         for r in result["rows"]])
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> None:
    settings = parse_args(argv)
    result = run(settings)
    print(report(result), end="")
    if settings.json:
        with open(settings.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
