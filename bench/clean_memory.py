"""Peak memory of cleaning one big page against the same text in lines (issue 68, item 4).

    cd /work/main && .venv/bin/python bench/clean_memory.py             # a 50 MB page
    .venv/bin/python bench/clean_memory.py --mb 10

The text: the bundled corpus's paragraphs (data/sample/*.txt.gz), repeated to --mb MB (10**6
bytes of UTF-8), every tenth one ending in Persian with a ZWNJ, a Malayalam chillu, an emoji
family and a zero-width space inside a word, so that every step of the cleaner has work and the
page is a str of 4 bytes a character (it holds characters above U+FFFF). Each way runs in its
own Python process: data_prep.clean.Cleaner().normalize on the whole page ("\\n"-joined), or on
each paragraph in turn (its output dropped, as prep passes it on). Printed per way: the peak of
Python's allocations while cleaning, over the text already held (tracemalloc), in MB and as a
multiple of the page's str, the process's peak RSS and the seconds; then the ratio page / lines.
"""

import argparse
import glob
import gzip
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_prep.clean import Cleaner  # noqa: E402

MIXED = (" \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \u0d05\u0d35\u0d28\u0d4d\u200d "
         "\U0001f468\u200d\U0001f469\u200d\U0001f467 Asso\u200bciation.")


def paragraphs(megabytes: float) -> list:
    """The bundled corpus's paragraphs, one a line, repeated to `megabytes` MB."""
    corpus = []
    for path in sorted(glob.glob(os.path.join(ROOT, "data", "sample", "*.txt.gz"))):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            corpus += [" ".join(text.split()) for text in file.read().split("\n\n") if text.strip()]
    lines, size = [], 0
    while size < megabytes * 10 ** 6:
        line = corpus[len(lines) % len(corpus)] + (MIXED if len(lines) % 10 == 0 else "")
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return lines


def measure(way: str, megabytes: float) -> dict:
    lines = paragraphs(megabytes)
    page = "\n".join(lines)
    normalize = Cleaner().normalize
    normalize(MIXED)  # the lazily built parts built before measuring
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    if way == "page":
        cleaned = normalize(page)
        del cleaned
    else:
        for line in lines:
            normalize(line)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    return {"way": way, "utf8_mb": len(page.encode("utf-8")) / 1e6,
            "str_mb": sys.getsizeof(page) / 1e6, "peak_mb": peak / 1e6,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
            "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50, help="MB of text (default 50)")
    parser.add_argument("--way", choices=("page", "lines"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.mb)))
        return
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; {args.mb:g} MB of text")
    results = {}
    for way in ("page", "lines"):
        out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--way", way],
                             check=True, capture_output=True, text=True).stdout
        results[way] = result = json.loads(out)
        print(f"{way:5s}: peak {result['peak_mb']:8.1f} MB over the text held "
              f"({result['peak_mb'] / result['str_mb']:.2f}x the page's str of "
              f"{result['str_mb']:.0f} MB, {result['utf8_mb']:.0f} MB of UTF-8), "
              f"peak RSS {result['max_rss_mb']:.0f} MB, {result['seconds']:.1f} s")
    ratio = results["page"]["peak_mb"] / max(results["lines"]["peak_mb"], 1e-9)
    print(f"page / lines: {ratio:.0f}x the peak")


if __name__ == "__main__":
    main()
