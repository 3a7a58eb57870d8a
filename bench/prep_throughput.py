"""Throughput of the corpus stage (data_prep.prepare) next to the bare libraries it wraps.

    cd /work/main && .venv/bin/python bench/prep_throughput.py            # --rounds 3 for a median

On the bundled corpus (data/sample/*.txt.gz) it measures, in one run:
  1. prepare() end to end with workers=1 and workers=2 (default options otherwise: minhash dedup,
     vocab 32768; quiet; a fresh temporary output folder each), every run in its own Python process
     as the CLI would be, so that RAYON_NUM_THREADS (which prepare() sets from --workers) and
     tokenizers' thread pool start fresh. MB/s = manifest bytes_in / seconds of each stage.
  2. the bare libraries on the same text, in this process: spaCy's blank("en") + sentencizer over
     the blank-line paragraphs (nlp.pipe, one process), then HF tokenizers' encode_batch of the
     sentences it found, with the tokenizer.json of the workers=1 run (its own threads).
  3. the project's targets: end to end >= 0.7x the slower bare library stage, 2 workers >= 1.6x one.
MB = 10**6 bytes of decompressed input. Informational: PASS/FAIL lines, exit status 0.
With --rounds N the runs are interleaved N times and the median of each figure is used.
"""

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# The library calls are timed as the 1-worker run makes them: tokenizers on one thread.
os.environ["RAYON_NUM_THREADS"] = "1"

import spacy  # noqa: E402
import tokenizers  # noqa: E402
from datasketch import MinHash, MinHashLSH  # noqa: E402
from sacremoses import MosesPunctNormalizer  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_prep.tokenizer import train_tokenizer  # noqa: E402  (the trainer settings prepare() uses)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sample")
MB = 1e6
PREPARE = ("import sys, warnings; warnings.filterwarnings('ignore'); "
           "from data_prep.pipeline import PrepConfig, prepare; "
           "prepare(PrepConfig(inputs=[sys.argv[1]], output=sys.argv[2], workers=int(sys.argv[3]), "
           "quiet=True))")
# manifest "seconds" keys: summed over worker processes (time inside the stage), or wall clock
STAGES = [("clean", "worker-s"), ("dedup", "worker-s"), ("split", "worker-s"),
          ("read_clean_dedup_split_wall", "wall"), ("train_bpe_after_pass", "wall"),
          ("encode_write", "wall"), ("total", "wall")]

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (median used)")
parser.add_argument("--spacy-batch", type=int, default=256, help="nlp.pipe batch_size")
parser.add_argument("--encode-batch", type=int, default=8192, help="sentences per encode_batch")
args = parser.parse_args()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", load avg %.2f %.2f %.2f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    return (f"machine: {cpu}, {os.cpu_count()} logical cores{load}\n"
            f"python {platform.python_version()}, spacy {spacy.__version__}, "
            f"tokenizers {tokenizers.__version__}, RAYON_NUM_THREADS="
            f"{os.environ.get('RAYON_NUM_THREADS', '(unset: all cores)')}")


def paragraphs(folder: str):
    """(documents, bytes): blank-line paragraphs of every .txt.gz, whitespace collapsed."""
    documents, size = [], 0
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".txt.gz"):
            continue
        lines = []
        with gzip.open(os.path.join(folder, name), "rb") as f:
            for raw in f:
                size += len(raw)
                line = raw.decode("utf-8", errors="replace")
                if line.strip():
                    lines.append(line)
                elif lines:
                    documents.append(" ".join("".join(lines).split()))
                    lines = []
        if lines:
            documents.append(" ".join("".join(lines).split()))
    return documents, size


def run_prepare(workers: int, output: str):
    """(manifest, seconds of the whole process incl. imports) of one prepare() run."""
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}  # prepare() sets it
    done = subprocess.run([sys.executable, "-c", PREPARE, CORPUS, output, str(workers)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"prepare(workers={workers}) failed:\n{done.stderr}")
    with open(os.path.join(output, "manifest.json")) as f:
        return json.load(f), wall


def bare_spacy(documents):
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    start = time.perf_counter()
    docs = nlp.pipe(documents, batch_size=args.spacy_batch)
    sentences = [s.text for doc in docs for s in doc.sents]
    return sentences, time.perf_counter() - start


def bare_moses(documents):
    normalizer = MosesPunctNormalizer(lang="en")
    start = time.perf_counter()
    for document in documents:
        normalizer.normalize(document)
    return time.perf_counter() - start


def bare_minhash(documents):
    """datasketch's MinHash (128 permutations) of each paragraph's 5-word shingles, then its LSH
    (threshold 0.8) query and insert: the library calls of --dedup minhash."""
    shingles = []
    for document in documents:
        words = document.lower().split()
        shingles.append([" ".join(words[i:i + 5]).encode() for i in range(max(1, len(words) - 4))])
    permutations = MinHash(num_perm=128, scheme="affine32").permutations
    lsh = MinHashLSH(threshold=0.8, num_perm=128, weights=(0.2, 0.8))
    start = time.perf_counter()
    for key, grams in enumerate(shingles):
        sketch = MinHash(num_perm=128, permutations=permutations, scheme="affine32")
        sketch.update_batch(grams)
        if not lsh.query(sketch):
            lsh.insert(key, sketch)
    return time.perf_counter() - start


def bare_bpe(sentences):
    start = time.perf_counter()
    train_tokenizer(iter(sentences), vocab_size=32768, min_frequency=2, show_progress=False)
    return time.perf_counter() - start


def bare_tokenizers(sentences, tokenizer_json: str):
    tokenizer = Tokenizer.from_file(tokenizer_json)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(sentences), args.encode_batch):
        batch = sentences[i:i + args.encode_batch]
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
    return tokens, time.perf_counter() - start


print(machine())
documents, size = paragraphs(CORPUS)
print(f"corpus: {CORPUS}, {len(documents):,} paragraphs, {size / MB:.2f} MB decompressed\n")

results = {"w1": [], "w2": [], "w1_process": [], "w2_process": [], "spacy": [], "tokenizers": [],
           "library_seconds": []}
manifests = {}
with tempfile.TemporaryDirectory(prefix="prep-bench-") as tmp:
    for r in range(args.rounds):
        for workers in (1, 2):
            output = os.path.join(tmp, f"round{r}-w{workers}")
            manifest, process = run_prepare(workers, output)
            manifests.setdefault(workers, []).append(manifest)
            results[f"w{workers}"].append(manifest["bytes_in"] / manifest["seconds"]["total"] / MB)
            results[f"w{workers}_process"].append(process)
        sentences, seconds = bare_spacy(documents)
        results["spacy"].append(size / seconds / MB)
        tokenizer_json = os.path.join(tmp, f"round{r}-w1", "tokenizer.json")
        tokens, seconds = bare_tokenizers(sentences, tokenizer_json)
        results["tokenizers"].append(size / seconds / MB)
        results["library_seconds"].append(size / MB / results["spacy"][-1] + seconds + bare_moses(documents)
                                          + bare_minhash(documents) + bare_bpe(sentences))
        last = {key: values[-1] for key, values in results.items()}
        print(f"round {r + 1}: e2e w1 {last['w1']:.3f}  w2 {last['w2']:.3f}  bare spaCy "
              f"{last['spacy']:.3f}  bare tokenizers {last['tokenizers']:.3f} MB/s  "
              f"({len(sentences):,} sentences, {tokens:,} tokens)")

median = {key: statistics.median(values) for key, values in results.items()}
m1, m2 = manifests[1][0], manifests[2][0]
print(f"\nprepare(), bytes_in {m1['bytes_in']:,}, documents in/out {m1['documents_in']:,}/"
      f"{m1['documents_out']:,}, sentences {m1['sentences']:,}, tokens {m1['tokens']:,}"
      + (" (round 1; MB/s: median of rounds)" if args.rounds > 1 else ""))
print(f"{'stage':30s} {'kind':9s} {'w1 s':>8s} {'w1 MB/s':>8s} {'w2 s':>8s} {'w2 MB/s':>8s}")
for stage, kind in STAGES:
    s1 = statistics.median(m["seconds"][stage] for m in manifests[1])
    s2 = statistics.median(m["seconds"][stage] for m in manifests[2])
    print(f"{stage:30s} {kind:9s} {s1:8.2f} {m1['bytes_in'] / s1 / MB:8.3f} "
          f"{s2:8.2f} {m2['bytes_in'] / s2 / MB:8.3f}")
print("worker-s: time inside the stage summed over worker processes (dedup adds the LSH in the "
      "main\n          process), so with 2 workers it is per-core throughput; wall: wall clock.")
print(f"{'python process, incl. imports':30s} {'wall':9s} {median['w1_process']:8.2f} "
      f"{m1['bytes_in'] / median['w1_process'] / MB:8.3f} {median['w2_process']:8.2f} "
      f"{m2['bytes_in'] / median['w2_process'] / MB:8.3f}")

print("\nbare libraries on the same text (MB/s of the decompressed input):")
print(f"  spaCy blank('en') + sentencizer, nlp.pipe(batch_size={args.spacy_batch}), one process: "
      f"{median['spacy']:.3f}")
threads = os.environ.get("RAYON_NUM_THREADS", "unset")
print(f"  tokenizers encode_batch({args.encode_batch} sentences), its own threads "
      f"(RAYON_NUM_THREADS={threads}): {median['tokenizers']:.3f}")
slower = min(median["spacy"], median["tokenizers"])
bound = 0.7 * slower
name = "spaCy" if median["spacy"] <= median["tokenizers"] else "tokenizers"
print(f"  slower bare stage: {name} {slower:.3f} MB/s; 0.7x of it: {bound:.3f} MB/s")

print("\nratios:")
print(f"  e2e w1 / slower bare stage: {median['w1'] / slower:.3f}")
print(f"  e2e w2 / slower bare stage: {median['w2'] / slower:.3f}")
print(f"  e2e w2 / e2e w1:            {median['w2'] / median['w1']:.3f}")

library = median["library_seconds"]
e2e_w1 = size / MB / median["w1"]
print(f"\nall library calls of the pipeline, bare, one process (Moses, MinHash+LSH, spaCy, BPE "
      f"training, encode): {library:.2f} s;\n  the 1-worker run takes {e2e_w1:.2f} s: glue (our code "
      f"around them) is {1 - library / e2e_w1:.0%} of it")

print("\ntargets (informational):")
verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
w1, w2 = median["w1"], median["w2"]
print(f"  {verdict(w2 >= bound)}  e2e (2 workers) {w2:.3f} MB/s >= 0.7 x slower bare stage "
      f"{bound:.3f} MB/s")
print(f"  {verdict(w1 >= bound)}  e2e (1 worker)  {w1:.3f} MB/s >= 0.7 x slower bare stage "
      f"{bound:.3f} MB/s  (same bound, for reference)")
print(f"  {verdict(library / e2e_w1 >= 0.7)}  glue under 30% of the 1-worker run "
      f"({1 - library / e2e_w1:.0%}; the reading of the target's parenthesis)")
print(f"  {verdict(w2 >= 1.6 * w1)}  2 workers {w2:.3f} MB/s >= 1.6 x 1 worker {1.6 * w1:.3f} MB/s "
      f" ({w2 / w1:.2f}x)")
