"""How padded real batches are: tupe_ds packs FULL-SENTENCES samples "[CLS] s1 s2 ... [SEP]" of
up to seq tokens greedily (a sentence that does not fit starts the next sample), so most samples
are shorter than seq and padded, and a micro-batch with one padded sample reaches the attention
with a mask.

For each prepared data folder (written by tupe-prep) and sequence length, this draws the train
split's batches through the loader tupe-pretrain runs (Vocabulary, PackedSentences,
MaskedSamples, TrainBatches, as tupe_ds/train/datasets.py builds them; one data-parallel rank, which
sees the same micro-batches as any rank would: consecutive samples of the epoch's order) and
counts, from each micro-batch's attention mask: the share of samples padded, the share of
micro-batches with at least one padded sample, the real length (mean, median, p10, p90) and the
share of positions that are padding. Counts, not timings: any machine gives the same figures.

    python bench/padding.py --data build/sample-prep build/wikitext-2-prep --json build/padding.json
    python bench/padding.py --data build/sample-prep --write-lengths bench/sample_lengths.json

Defaults: seq 128 and 512, micro-batches of 8192 tokens (64 x 128, 16 x 512), global batch 256,
every whole step of one epoch (--steps N for fewer). --write-lengths writes the histogram of real
lengths of the first --data folder per seq, which bench/real_lengths.py draws from.
"""

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tupe_ds.tools.third_party_warnings  # noqa: F401,E402  (first: filters import warnings)
from tupe_ds.data.loader import TrainBatches, Vocabulary  # noqa: E402
from tupe_ds.data.masking import BERT_MASKING, MaskedSamples  # noqa: E402
from tupe_ds.data.packing import PackedSentences  # noqa: E402
from tupe_ds.tools.files import write_atomically  # noqa: E402

TOKENS_PER_MICRO_BATCH = 8192
GLOBAL_BATCH = 256
SEED = 1234  # tupe-pretrain's default --seed: the epoch order of its first epoch


def default_micro_batch(seq_len: int) -> int:
    return max(1, TOKENS_PER_MICRO_BATCH // seq_len)


def train_batches(data_dir: str, seq_len: int, micro_batch: int, global_batch: int,
                  index_cache: str) -> TrainBatches:
    """The train split's micro-batches as tupe-pretrain makes them, for one data-parallel rank."""
    vocab = Vocabulary.from_data_dir(data_dir)
    packed = PackedSentences(os.path.join(data_dir, "train"), seq_len, vocab.cls, vocab.sep,
                             index_cache)
    samples = MaskedSamples(packed, vocab, BERT_MASKING, SEED)
    return TrainBatches(samples, micro_batch, global_batch // micro_batch, dp_rank=0, dp_size=1)


def epoch_steps(batches: TrainBatches) -> int:
    """The whole optimizer steps of one epoch (at least one)."""
    return max(1, len(batches.samples.packed) // batches.global_batch)


def micro_batch_lengths(batches: TrainBatches, steps: int) -> np.ndarray:
    """Real lengths [micro-batches, micro_batch]: each row's count of attention-mask ones."""
    return np.stack([batch["attention_mask"].sum(dim=1).numpy()
                     for _ in range(steps) for batch in batches.next_step()])


def padding_figures(lengths: np.ndarray, seq_len: int) -> dict:
    """What padding real lengths [micro-batches, micro_batch] mean at seq_len."""
    padded = lengths < seq_len
    flat = lengths.ravel()
    return {"samples": int(flat.size), "micro_batches": len(lengths),
            "padded_samples": float(padded.mean()),
            "padded_micro_batches": float(padded.any(axis=1).mean()),
            "length_mean": float(flat.mean()), "length_median": float(np.median(flat)),
            "length_p10": float(np.percentile(flat, 10)),
            "length_p90": float(np.percentile(flat, 90)),
            "padding_positions": float(1 - flat.sum() / (flat.size * seq_len)),
            "length_counts": np.bincount(flat, minlength=seq_len + 1).tolist()}


def measure(data_dir: str, seq_len: int, micro_batch: int = None,
            global_batch: int = GLOBAL_BATCH, steps: int = None, index_cache: str = None) -> dict:
    """Padding figures of `steps` optimizer steps (default: one epoch's) of the data folder's
    train batches at seq_len. The sample index goes to `index_cache` (default: the folder)."""
    micro_batch = micro_batch or default_micro_batch(seq_len)
    if global_batch % micro_batch:
        raise ValueError(f"global batch {global_batch} is not a multiple of micro-batch "
                         f"{micro_batch}")
    batches = train_batches(data_dir, seq_len, micro_batch, global_batch, index_cache or data_dir)
    steps = steps or epoch_steps(batches)
    lengths = micro_batch_lengths(batches, steps)
    return {"corpus": corpus_name(data_dir), "data": os.path.abspath(data_dir),
            "seq_len": seq_len, "micro_batch": micro_batch, "global_batch": global_batch,
            "steps": steps, "packed_samples": len(batches.samples.packed),
            **padding_figures(lengths, seq_len)}


def corpus_name(data_dir: str) -> str:
    return os.path.basename(os.path.normpath(data_dir))


def percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def table(results: list) -> str:
    """A markdown table of the figures, one row per corpus and seq."""
    lines = ["| corpus | seq | micro-batch | samples (packed) | padded samples | micro-batches "
             "with a padded sample | real length mean / median / p10 / p90 | padding positions |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        lengths = " / ".join(f"{r[key]:.0f}" for key in
                             ("length_mean", "length_median", "length_p10", "length_p90"))
        lines.append(f"| {r['corpus']} | {r['seq_len']} | {r['micro_batch']} | "
                     f"{r['samples']:,} ({r['packed_samples']:,}) | "
                     f"{percent(r['padded_samples'])} | {percent(r['padded_micro_batches'])} | "
                     f"{lengths} | {percent(r['padding_positions'])} |")
    return "\n".join(lines)


def length_histograms(results: list) -> dict:
    """bench/sample_lengths.json: the real-length histogram of each seq, counts[length]."""
    return {"about": "real sample lengths as tupe_ds's loader gives them (bench/padding.py); "
                     "counts[L] = samples of real length L (tokens, [CLS] and [SEP] included)",
            "corpus": results[0]["corpus"],
            "seq_len": {str(r["seq_len"]): {"micro_batch": r["micro_batch"], "steps": r["steps"],
                                            "samples": r["samples"],
                                            "length_mean": round(r["length_mean"], 2),
                                            "counts": r["length_counts"]}
                        for r in results}}


def compact_json(histograms: dict) -> str:
    """JSON with each seq's entry on one line: a few KB that read well in a diff."""
    head = "".join(f" {json.dumps(key)}: {json.dumps(value)},\n"
                   for key, value in histograms.items() if key != "seq_len")
    entries = ",\n".join(f"  {json.dumps(seq)}: {json.dumps(entry)}"
                         for seq, entry in histograms["seq_len"].items())
    return "{\n" + head + ' "seq_len": {\n' + entries + "\n }\n}\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", required=True, help="folders written by tupe-prep")
    parser.add_argument("--seq-lens", default="128,512", help="comma-separated (128,512)")
    parser.add_argument("--micro-batch", type=int,
                        help=f"samples per micro-batch (default: {TOKENS_PER_MICRO_BATCH} tokens)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--steps", type=int, help="optimizer steps (default: one epoch's)")
    parser.add_argument("--index-cache", help="where sample indexes go (default: each folder)")
    parser.add_argument("--json", help="write every figure here (atomically)")
    parser.add_argument("--write-lengths", metavar="PATH",
                        help="write the first --data folder's real-length histograms here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    seq_lens = [int(seq) for seq in args.seq_lens.split(",")]
    results = [measure(data_dir, seq_len, args.micro_batch, args.global_batch, args.steps,
                       args.index_cache)
               for data_dir in args.data for seq_len in seq_lens]
    print(table(results))
    if args.json:
        write_atomically(args.json, json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.write_lengths:
        first = [r for r in results if r["data"] == results[0]["data"]]
        write_atomically(args.write_lengths, compact_json(length_histograms(first)))


if __name__ == "__main__":
    main()
