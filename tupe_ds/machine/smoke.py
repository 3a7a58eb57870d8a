"""tupe-smoke: build each positional encoding, train it a few AdamW steps, report what happened.

    tupe-smoke                                  # tiny model, all nine encodings, CPU is enough
    tupe-smoke --preset bert-base --encodings tupe-r bert-a --steps 5

Every model sees the same fixed masked-LM batch, so the loss must fall as it memorises it; a loss
that does not fall, or is not finite, makes the command exit non-zero.
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import argparse
import logging
import math
import sys
import time

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tupe_ds.data.masking import IGNORE_INDEX
from tupe_ds.distributed.parallel import accelerator_device
from tupe_ds.model import ENCODINGS, PRESETS, build_model
from tupe_ds.model.config import COMPILE
from tupe_ds.tools import command_line, entry, log_lines

MASK_PROBABILITY = 0.15


def masked_batch(batch: int, seq: int, vocab: int, seed: int):
    """Random tokens, the last quarter of the second half padded, 15% of real tokens as labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[batch // 2:, seq - seq // 4:] = 0
    chosen = (torch.rand(batch, seq, generator=generator) < MASK_PROBABILITY) & (mask == 1)
    labels = ids.masked_fill(~chosen, IGNORE_INDEX)
    return ids.masked_fill(chosen, 4), mask, labels  # 4 stands in for [MASK]


def train(encoding: str, args) -> dict:
    torch.manual_seed(args.seed)
    torch._dynamo.reset()  # the earlier encodings' graphs: dynamo keeps 8 of a function
    model = build_model(args.preset, pos_encoding=encoding, seq_length=args.seq,
                        compile=args.compile,
                        max_position_embeddings=max(args.seq, PRESETS[args.preset].get(
                            "max_position_embeddings", 512)))
    vocab = model.model_config.vocab_size
    device = accelerator_device()
    ids, mask, labels = (t.to(device) for t in masked_batch(args.batch, args.seq, vocab, args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, start = [], time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"{encoding:>15}", leave=False, disable=args.quiet):
        loss, _ = model(ids, mask, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "encoding": encoding,
        "params": sum(p.numel() for p in model.parameters()),
        "first": losses[0],
        "last": losses[-1],
        "ms": 1000 * (time.perf_counter() - start) / args.steps,
        "scores": model.model_config.encoding.has_positional_logits,
    }


def main(argv=None) -> int:
    return entry.run("tupe-smoke", lambda: smoke(argv))


def smoke(argv) -> int:
    """tupe-smoke's work: each encoding trained a few steps; 1 where its loss did not fall."""
    parser = command_line.Parser(prog="tupe-smoke", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     allow_abbrev=False)
    add_verbose_flag(parser)
    command_line.add_config_flags(parser)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--encodings", nargs="+", default=list(ENCODINGS), choices=list(ENCODINGS))
    parser.add_argument("--steps", type=command_line.positive, default=30)
    parser.add_argument("--batch", type=command_line.positive, default=8)
    parser.add_argument("--seq", type=command_line.positive, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", choices=list(COMPILE), default="none",
                        help="what torch.compile takes as one region (default none, eager: "
                             "each encoding would compile its own; block checks the compiled "
                             "encoder of each here)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = command_line.parse(parser, argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 to see the loss move")
    if not 0 < args.lr < math.inf:  # nan compares false
        parser.error(f"--lr {args.lr}: a learning rate is a positive, finite number")

    print(f"preset {args.preset}, batch {args.batch} x {args.seq} tokens, {args.steps} AdamW steps, "
          f"device {accelerator_device()}")
    print(f"{'encoding':>15} {'params':>11} {'loss first':>10} {'loss last':>10} {'ms/step':>8}  "
          "positional_scores")
    log_lines.show(rank=0)  # each encoding's compile, with --compile block
    failed = []
    for encoding in args.encodings:
        with logging_redirect_tqdm([logging.getLogger("tupe_ds")]):  # a line of its own
            r = train(encoding, args)
        print(f"{r['encoding']:>15} {r['params']:>11,} {r['first']:>10.3f} {r['last']:>10.3f} "
              f"{r['ms']:>8.1f}  {'[heads, n, n]' if r['scores'] else '-'}")
        if not (math.isfinite(r["last"]) and r["last"] < r["first"]):
            failed.append(encoding)
    if failed:
        print(f"FAILED: the loss did not fall for {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"ok: the loss fell for all {len(args.encodings)} encodings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
