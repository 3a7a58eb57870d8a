"""Throughput of the corpus stage (data_prep.prepare) next to the bare libraries it wraps.

    cd /work/main && .venv/bin/python bench/prep_throughput.py            # --rounds 3 for a median
    .venv/bin/python bench/prep_throughput.py --generate 100 --workers 2  # generated, 100 MB

On the bundled corpus (data/sample/*.txt.gz) it measures, in one run:
  1. prepare() end to end with workers=1 and workers=2 (default options otherwise: minhash dedup,
     vocab 32768; quiet; a fresh temporary output folder each), every run in its own Python process
     through the tupe-prep command's main() (with its pause of the garbage collector while the
     libraries import), so that RAYON_NUM_THREADS (which prepare() sets from --workers) and
     tokenizers' thread pool start fresh. MB/s = manifest bytes_in / seconds of each stage; each
     run's CPU seconds (its process and its workers) and peak RSS (the larger of the main process
     and any one worker; it counts mapped files' pages) are printed too, and the peak anonymous
     memory (Pss_Anon of the process and its workers together) of one more run, sampled and not
     timed. With --reference, the same runs again with the reference sentence splitter (spaCy's
     sentencizer on the whole text) and Moses normalizer (sacremoses' own normalize),
     interleaved with the default ones.
  2. the bare libraries on the same text, in this process: spaCy's blank("en") + sentencizer over
     the blank-line paragraphs (nlp.pipe, one process), then HF tokenizers' encode_batch of the
     sentences it found, with the tokenizer.json of the workers=1 run (its own threads).
  3. the project's targets: end to end >= 0.7x the slower bare library stage, 2 workers >= 1.6x one,
     end to end >= 1 MB/s with 2 workers (issue 45).
--generate MB writes a corpus of that many MB (blank-line paragraphs of the bundled corpus,
shuffled, pairs of them joined, ~15% of their words replaced by others of the corpus:
de-duplication keeps nearly all) and runs only part 1 on it. MB = 10**6 bytes of decompressed
input. Informational: PASS/FAIL lines, exit status 0. With --rounds N the runs are interleaved N
times and the median of each figure is used.
"""

import argparse
import gzip
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The library calls are timed as the 1-worker run makes them: tokenizers on one thread.
os.environ["RAYON_NUM_THREADS"] = "1"

import spacy  # noqa: E402
import tokenizers  # noqa: E402
from datasketch import MinHash  # noqa: E402
from datasketch.hashfunc import sha1_hash32  # noqa: E402
from sacremoses import MosesPunctNormalizer  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_prep.near import SCHEME, WORD  # noqa: E402  (the shingles and scheme prepare() uses)
from data_prep.tokenizer import train_tokenizer  # noqa: E402  (the trainer settings prepare() uses)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sample")
MB = 1e6
# One run, in its own process, as the tupe-prep command (its collector pause after imports
# included: data_prep/cli.py, tupe_ds/tools/startup.py); with argv[4] == "reference", the
# reference sentence splitter and Moses normalizer (the workers are forked after the change).
# Prints its CPU seconds and peak RSS.
PREPARE = ("import sys; args = sys.argv[1:]; sys.argv = ['tupe-prep']; "
           "from tupe_ds.tools import startup; "
           "import functools, json, resource, warnings; warnings.filterwarnings('ignore'); "
           "import data_prep.workers as p; from data_prep.cli import main; "
           "reference = args[3] == 'reference'; "
           "p.SentenceSplitter = functools.partial(p.SentenceSplitter, splitter='sentencizer') "
           "if reference else p.SentenceSplitter; "
           "p.Cleaner = functools.partial(p.Cleaner, moses='sacremoses') if reference "
           "else p.Cleaner; "
           "use = lambda who: resource.getrusage(who); before = use(resource.RUSAGE_SELF); "
           "main(['--input', args[0], '--out', args[1], '--workers', args[2], '--quiet']); "
           "me, kids = use(resource.RUSAGE_SELF), use(resource.RUSAGE_CHILDREN); "
           "print(json.dumps({'cpu': me.ru_utime + me.ru_stime - before.ru_utime - before.ru_stime "
           "+ kids.ru_utime + kids.ru_stime, 'rss_mb': max(me.ru_maxrss, kids.ru_maxrss) / 1024}))")
# manifest "seconds" keys: summed over worker processes (time inside the stage), or wall clock
STAGES = [("clean", "worker-s"), ("dedup", "worker-s"), ("split", "worker-s"),
          ("read_clean_dedup_split_wall", "wall"), ("train_bpe_after_pass", "wall"),
          ("encode_write", "wall"), ("total", "wall")]

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (median used)")
parser.add_argument("--spacy-batch", type=int, default=256, help="nlp.pipe batch_size")
parser.add_argument("--encode-batch", type=int, default=8192, help="sentences per encode_batch")
parser.add_argument("--generate", type=float, default=0,
                    help="MB of generated corpus to run prepare() on instead (no bare libraries)")
parser.add_argument("--workers", default="1,2", help="prepare() runs, by --workers (comma list)")
parser.add_argument("--reference", action="store_true",
                    help="also runs with the reference sentence splitter and Moses normalizer")
args = parser.parse_args()
WORKERS = [int(w) for w in args.workers.split(",")]


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


def generate(path: str, megabytes: float, seed: int = 0) -> None:
    """A .txt corpus of `megabytes` MB: pairs of the bundled corpus's paragraphs, shuffled, with
    about 15% of their words replaced by words drawn from the corpus (so that few documents are
    near duplicates of each other), one document per blank-line paragraph. Streamed to disk."""
    rng = random.Random(seed)
    documents, _ = paragraphs(CORPUS)
    vocabulary = [word for document in documents[:2000] for word in document.split()]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * MB:
            words = " ".join(rng.sample(documents, 2)).split()
            for i in range(len(words)):
                if rng.random() < 0.15:
                    words[i] = rng.choice(vocabulary)
            text = " ".join(words) + "\n\n"
            f.write(text)
            written += len(text.encode("utf-8"))


def anonymous_mb(pid: int) -> float:
    """Pss_Anon of a process and its children (/proc), MB: the memory only they hold, not the
    page cache of the files they map, each page shared by fork counted once."""
    total = 0.0
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss_Anon:"):
                total = int(line.split()[1]) / 1024
        children = []  # of every thread: prepare() forks its workers from tokenizers' threads
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
    except OSError:  # gone, or no /proc
        return total
    return total + sum(anonymous_mb(child) for child in children)


def run_prepare(workers: int, output: str, reference: bool = False, sample: bool = False):
    """(manifest, seconds of the whole process incl. imports, CPU s and peak RSS MB of one run);
    with `sample`, its peak anonymous MB (the process and its workers together, every 0.1 s)
    in the usage too. Reading smaps_rollup takes ~10 ms of a core per process, so the timed
    runs are not sampled."""
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}  # prepare() sets it
    process = subprocess.Popen([sys.executable, "-c", PREPARE, corpus, output, str(workers),
                                "reference" if reference else "default"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    anonymous = 0.0
    while sample and process.poll() is None:
        anonymous = max(anonymous, anonymous_mb(process.pid))
        time.sleep(0.1)
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode:
        sys.exit(f"prepare(workers={workers}) failed:\n{stderr}")
    with open(os.path.join(output, "manifest.json")) as f:
        usage = json.loads(stdout.strip().splitlines()[-1])
        return json.load(f), wall, {**usage, "anonymous_mb": anonymous}


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
    """The library calls of --dedup minhash (data_prep/near.py): datasketch's sha1_hash32 of each
    distinct 5-word shingle of a paragraph, then the MinHash signature (128 permutations, affine32)
    of those hashes. The shingles are made before the clock starts; the LSH candidates and their
    exact check are the project's own code (near.py, dedup.py), not timed here."""
    shingles = []
    for document in documents:
        words = WORD.findall(document.lower())
        shingles.append([g.encode("utf-8") for g in
                         {" ".join(words[i:i + 5]) for i in range(max(1, len(words) - 4))}])
    permutations = MinHash(num_perm=128, scheme=SCHEME).permutations
    start = time.perf_counter()
    for grams in shingles:
        hashes = sorted({sha1_hash32(g) for g in grams})
        sketch = MinHash(num_perm=128, hashfunc=int, permutations=permutations, scheme=SCHEME)
        sketch.update_batch(hashes)
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


def mb_per_s(manifest: dict) -> float:
    return manifest["bytes_in"] / manifest["seconds"]["total"] / MB


def label(workers: int, reference: bool) -> str:
    return f"w{workers}" + (" ref" if reference else "")


print(machine())
variants = [(w, False) for w in WORKERS] + ([(w, True) for w in WORKERS] if args.reference else [])
runs = {variant: [] for variant in variants}  # (manifest, process seconds, usage) of each round
bare = {"spacy": [], "tokenizers": [], "library_seconds": []}
with tempfile.TemporaryDirectory(prefix="prep-bench-") as tmp:
    if args.generate:
        corpus = os.path.join(tmp, "generated", "corpus.txt")
        os.makedirs(os.path.dirname(corpus))
        start = time.perf_counter()
        generate(corpus, args.generate)
        print(f"corpus: generated from {CORPUS}, {os.path.getsize(corpus) / MB:.2f} MB "
              f"(in {time.perf_counter() - start:.0f} s)\n")
    else:
        corpus = CORPUS
        documents, size = paragraphs(CORPUS)
        print(f"corpus: {CORPUS}, {len(documents):,} paragraphs, {size / MB:.2f} MB decompressed\n")
    for r in range(args.rounds):
        for workers, reference in variants:
            output = os.path.join(tmp, f"round{r}-{label(workers, reference).replace(' ', '-')}")
            runs[workers, reference].append(run_prepare(workers, output, reference))
            if (workers, reference) == variants[0] and not args.generate:
                shutil.copy(os.path.join(output, "tokenizer.json"), tmp)
            shutil.rmtree(output)  # a 100 MB corpus' outputs are not kept round after round
        line = "  ".join(f"{label(*v)} {mb_per_s(runs[v][-1][0]):.3f}" for v in variants)
        if not args.generate:
            sentences, seconds = bare_spacy(documents)
            bare["spacy"].append(size / seconds / MB)
            tokens, seconds = bare_tokenizers(sentences, os.path.join(tmp, "tokenizer.json"))
            bare["tokenizers"].append(size / seconds / MB)
            bare["library_seconds"].append(size / MB / bare["spacy"][-1] + seconds
                                           + bare_moses(documents) + bare_minhash(documents)
                                           + bare_bpe(sentences))
            line += (f"  bare spaCy {bare['spacy'][-1]:.3f}  bare tokenizers "
                     f"{bare['tokenizers'][-1]:.3f}")
        print(f"round {r + 1}, e2e MB/s: {line}  (load avg {os.getloadavg()[0]:.1f})")
    anonymous = {}  # one more run of each variant, its memory sampled, its time not counted
    for workers, reference in variants:
        output = os.path.join(tmp, f"memory-{label(workers, reference).replace(' ', '-')}")
        anonymous[workers, reference] = run_prepare(workers, output, reference,
                                                    sample=True)[2]["anonymous_mb"]
        shutil.rmtree(output)

median = {v: {"mbs": statistics.median(mb_per_s(m) for m, _, _ in runs[v]),
              "process": statistics.median(p for _, p, _ in runs[v]),
              "cpu": statistics.median(u["cpu"] for _, _, u in runs[v]),
              "rss": max(u["rss_mb"] for _, _, u in runs[v]),
              "anonymous": anonymous[v]} for v in variants}
first = runs[variants[0]][0][0]
print(f"\nprepare(), bytes_in {first['bytes_in']:,}, documents in/out {first['documents_in']:,}/"
      f"{first['documents_out']:,}, sentences {first['sentences']:,}, tokens {first['tokens']:,}"
      + (" (round 1; MB/s: median of rounds)" if args.rounds > 1 else ""))
print(f"{'stage':30s} {'kind':9s}" + "".join(f" {label(*v) + ' s':>10s} {'MB/s':>7s}"
                                             for v in variants))
for stage, kind in STAGES:
    row = f"{stage:30s} {kind:9s}"
    for v in variants:
        value = statistics.median(m["seconds"][stage] for m, _, _ in runs[v])
        row += f" {value:10.2f} {first['bytes_in'] / value / MB:7.3f}"
    print(row)
print("worker-s: time inside the stage summed over worker processes (dedup adds the LSH in the "
      "main\n          process), so with 2 workers it is per-core throughput; wall: wall clock.")
print(f"{'python process, incl. imports':30s} {'wall':9s}" + "".join(
    f" {median[v]['process']:10.2f} {first['bytes_in'] / median[v]['process'] / MB:7.3f}"
    for v in variants))
print(f"{'CPU s of prepare() (+workers)':30s} {'cpu':9s}" + "".join(
    f" {median[v]['cpu']:10.2f} {'':7s}" for v in variants))
print(f"{'peak RSS, MB (largest process)':30s} {'max':9s}" + "".join(
    f" {median[v]['rss']:10.0f} {'':7s}" for v in variants))
print(f"{'peak anonymous MB (all procs)':30s} {'max':9s}" + "".join(
    f" {median[v]['anonymous']:10.0f} {'':7s}" for v in variants))
print("RSS counts the pages of mapped files (page cache, reclaimable); anonymous memory is what "
      "the\nprocesses alone hold (Pss_Anon summed, sampled every 0.1 s in one more run).")
if args.reference:
    for workers in WORKERS:
        fast, slow = median[workers, False], median[workers, True]
        print(f"default / reference paths, {workers} worker(s): {fast['mbs'] / slow['mbs']:.2f}x "
              f"MB/s, {slow['cpu'] / fast['cpu']:.2f}x less CPU")

verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
if args.generate or not {(1, False), (2, False)} <= set(variants):
    if (2, False) in variants:
        w2 = median[2, False]["mbs"]
        print(f"\ntarget (informational):\n  {verdict(w2 >= 1.0)}  e2e (2 workers) {w2:.3f} MB/s "
              ">= 1 MB/s")
    sys.exit(0)

median.update({key: statistics.median(values) for key, values in bare.items()})
median["w1"], median["w2"] = median[1, False]["mbs"], median[2, False]["mbs"]
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
print(f"\nall library calls of the pipeline, bare, one process (Moses, MinHash signatures, spaCy, "
      f"BPE training, encode): {library:.2f} s\n  (spaCy: its sentencizer on whole texts, the "
      f"reference path; the default splitter tokenizes only pieces of them);\n  the 1-worker run "
      f"takes {e2e_w1:.2f} s: glue (our code around them) is {1 - library / e2e_w1:.0%} of it")

print("\ntargets (informational):")
w1, w2 = median["w1"], median["w2"]
print(f"  {verdict(w2 >= bound)}  e2e (2 workers) {w2:.3f} MB/s >= 0.7 x slower bare stage "
      f"{bound:.3f} MB/s")
print(f"  {verdict(w1 >= bound)}  e2e (1 worker)  {w1:.3f} MB/s >= 0.7 x slower bare stage "
      f"{bound:.3f} MB/s  (same bound, for reference)")
print(f"  {verdict(library / e2e_w1 >= 0.7)}  glue under 30% of the 1-worker run "
      f"({1 - library / e2e_w1:.0%}; the reading of the target's parenthesis)")
print(f"  {verdict(w2 >= 1.6 * w1)}  2 workers {w2:.3f} MB/s >= 1.6 x 1 worker {1.6 * w1:.3f} MB/s "
      f" ({w2 / w1:.2f}x)")
print(f"  {verdict(w2 >= 1.0)}  e2e (2 workers) {w2:.3f} MB/s >= 1 MB/s (issue 45)")
