"""The training data stream at corpus scale: sample index start-up, resident memory, host
throughput.

Writes a synthetic megatron-core indexed corpus of the chosen size once (random token ids,
sentence and document lengths drawn around BERT's corpus: ~22 tokens per sentence, ~15
sentences per document) into --cache, then, each in a fresh process pinned to one core:
  - the first start: the sample index built (packing compiled with numba) and saved;
  - a later start: the index memory-mapped;
  - resident memory of the stream after the start and after 200 micro-batches: anonymous
    (process-private, what a corpus-size dependence would show) and file-backed (mapped pages
    of the corpus and index, shared with the page cache);
  - samples/s at seq 128 and 512 (micro-batches of 64 and 16: read, packed, masked, as tensors),
    for the vectorised stream and the per-sample reference, next to what one H100 consumes.

    python bench/data_stream.py --size tenth        # 1M documents, 15M sentences, 330M tokens
    python bench/data_stream.py --size bert         # 10M documents, 150M sentences, 3.3B tokens
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {  # documents, sentences, tokens
    "tiny": (10_000, 150_000, 3_300_000),
    "tenth": (1_000_000, 15_000_000, 330_000_000),
    "bert": (10_000_000, 150_000_000, 3_300_000_000),
}
VOCAB_SIZE = 32768
# What one H100 consumes, samples/s (bench/results/h100-a01eb4b.md, Hugging Face BERT-Large with
# torch AMP; base sizes at the same efficiency are about three times as fast, as issue 21
# estimates).
H100_RATES = {128: {"BERT-Large": 901, "BERT-Base / ELECTRA-Base (estimate)": 2700},
              512: {"BERT-Large": 220, "BERT-Base / ELECTRA-Base (estimate)": 660}}
MICRO_BATCH = {128: 64, 512: 16}


def write_corpus(prefix: str, documents: int, sentences: int, tokens: int, seed: int = 0):
    """prefix.bin / prefix.idx in megatron-core's format (its _IndexWriter, with the pointers
    summed in numpy rather than its Python loop)."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter
    from tqdm import tqdm

    class IndexWriter(_IndexWriter):
        def _sequence_pointers(self, sequence_lengths):
            lengths = np.asarray(sequence_lengths, dtype=np.int64)
            return np.concatenate([[0], np.cumsum(lengths[:-1])]) * np.dtype(self.dtype).itemsize

    rng = np.random.default_rng(seed)
    lengths = rng.gamma(2.0, tokens / sentences / 2.0, size=sentences).astype(np.int64) + 1
    lengths = np.minimum(lengths, 4 * tokens // sentences)
    per_document = rng.multinomial(sentences - documents, np.full(documents, 1 / documents)) + 1
    document_indices = np.concatenate([[0], np.cumsum(per_document)])
    total = int(lengths.sum())
    with open(prefix + ".bin.tmp", "wb") as f:
        chunk = 1 << 26
        for start in tqdm(range(0, total, chunk), desc=f"{os.path.basename(prefix)}.bin", unit="chunk"):
            count = min(chunk, total - start)
            f.write(rng.integers(5, VOCAB_SIZE, size=count, dtype=np.uint16).tobytes())
    with IndexWriter(prefix + ".idx.tmp", np.uint16) as writer:
        writer.write(lengths.astype(np.int32), None, document_indices)
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return total


def memory() -> dict:
    """RssAnon and RssFile of this process, MB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                values[name] = int(rest.split()[0]) / 1024
    return values


def measure(prefix: str, cache: str, seq_lens, samples_per_run: int, reference_samples: int):
    """In this process (one core): start-up, memory and throughput of the stream; a dict."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import torch
    torch.set_num_threads(1)
    from tupe_ds.data.loader import TrainBatches, Vocabulary
    from tupe_ds.data.masking import BERT_MASKING, MaskedSamples
    from tupe_ds.data.packing import PackedSentences

    vocab = Vocabulary(size=VOCAB_SIZE, pad=0, cls=2, sep=3, mask=4, special=(0, 1, 2, 3, 4))
    result = {"memory_before_mb": memory(), "seq": {}}
    for seq_len in seq_lens:
        started = time.perf_counter()
        packed = PackedSentences(prefix, seq_len, vocab.cls, vocab.sep, cache)
        row = {"start_s": time.perf_counter() - started, "samples": len(packed),
               "memory_after_start_mb": memory()}
        micro_batch = MICRO_BATCH[seq_len]
        for vectorised, count in ((True, samples_per_run), (False, reference_samples)):
            stream = TrainBatches(MaskedSamples(packed, vocab, BERT_MASKING, 1234, vectorised),
                                  micro_batch=micro_batch, grad_accum=1, dp_rank=0, dp_size=1,
                                  consumed=len(packed) - count // 2)  # across an epoch's end
            steps = max(1, count // micro_batch)
            started = time.perf_counter()
            for _ in range(steps):
                list(stream.next_step())
            rate = steps * micro_batch / (time.perf_counter() - started)
            row["samples_per_s" if vectorised else "reference_samples_per_s"] = rate
            if vectorised:  # the reference reads through megatron-core's own mapping
                row["memory_after_batches_mb"] = memory()
        result["seq"][seq_len] = row
    return result


def in_fresh_process(args, prefix: str, cache: str, seq_lens) -> dict:
    command = [sys.executable, __file__, "--measure", prefix, "--cache", cache,
               "--seq-lens", ",".join(map(str, seq_lens)), "--samples", str(args.samples),
               "--reference-samples", str(args.reference_samples)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="tenth")
    p.add_argument("--cache", default=os.path.join(ROOT, "build", "bench-data-stream"),
                   help="folder of the synthetic corpora and their sample indexes")
    p.add_argument("--seq-lens", default="128,512")
    p.add_argument("--samples", type=int, default=12800, help="samples timed per stream")
    p.add_argument("--reference-samples", type=int, default=640,
                   help="samples timed for the per-sample reference")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # a corpus prefix: the child process
    args = p.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, args.cache, seq_lens, args.samples,
                                 args.reference_samples)))
        return 0

    documents, sentences, tokens = SIZES[args.size]
    folder = os.path.join(args.cache, args.size)
    prefix, index_cache = os.path.join(folder, "corpus"), os.path.join(folder, "index")
    os.makedirs(folder, exist_ok=True)
    if not os.path.exists(prefix + ".idx"):
        print(f"writing the synthetic corpus {prefix} ({documents:,} documents, {sentences:,} "
              f"sentences, ~{tokens:,} tokens), once", flush=True)
        write_corpus(prefix, documents, sentences, tokens)
    on_disk = sum(os.path.getsize(prefix + ext) for ext in (".bin", ".idx")) / 1e9
    for name in os.listdir(index_cache) if os.path.isdir(index_cache) else []:
        os.remove(os.path.join(index_cache, name))  # the first start builds them again

    first = in_fresh_process(args, prefix, index_cache, seq_lens)
    later = in_fresh_process(args, prefix, index_cache, seq_lens)
    print(f"\ncorpus: {args.size}, {documents:,} documents, {sentences:,} sentences, "
          f"{tokens / 1e9:.2f}B tokens, {on_disk:.1f} GB on disk; one core "
          f"({os.cpu_count()} here), {time.strftime('%Y-%m-%d')}")
    print("| seq | samples | first start (index built) | later start | anon MB after start / "
          "after batches | file-backed MB | samples/s vectorised | per-sample reference | "
          "H100 consumes |")
    print("|---|---|---|---|---|---|---|---|---|")
    before = later["memory_before_mb"]
    for seq_len in seq_lens:
        built, cached = first["seq"][str(seq_len)], later["seq"][str(seq_len)]
        anon = [cached[key]["RssAnon"] - before["RssAnon"]
                for key in ("memory_after_start_mb", "memory_after_batches_mb")]
        file_backed = cached["memory_after_batches_mb"]["RssFile"] - before["RssFile"]
        rates = ", ".join(f"{name} {rate} ({cached['samples_per_s'] / rate:.0f}x)"
                          for name, rate in H100_RATES[seq_len].items())
        print(f"| {seq_len} | {cached['samples']:,} | {built['start_s']:.1f} s | "
              f"{cached['start_s']:.2f} s | {anon[0]:+.0f} / {anon[1]:+.0f} | "
              f"{file_backed:+.0f} | {cached['samples_per_s']:,.0f} | "
              f"{cached['reference_samples_per_s']:,.0f} | {rates} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "first": first, "later": later}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
