"""tupe-prep: raw text -> cleaned, de-duplicated, sentence-split, BPE-encoded indexed datasets.

    tupe-prep --input corpus/ --out data/prep
    tupe-prep --input part-*.jsonl.gz --out data/shard0 --tokenizer tok.json --shard 0/4
    tupe-prep merge --out data/all data/shard0 data/shard1 data/shard2 data/shard3
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import argparse
import logging
import sys

# megatron-core's import says, once per process, that it falls back from Apex/TE: not our news.
from data_prep.merge import merge
from data_prep.pipeline import PrepConfig, prepare
from data_prep.read import InputError
from tupe_ds.tools import command_line, entry
from tupe_ds.tools.errors import CommandRefused

logger = logging.getLogger(__name__)


def shard(value: str):
    try:
        index, count = (int(v) for v in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {value!r}") from None
    return index, count


def add_out_flag(p: argparse.ArgumentParser) -> None:
    # --out as every other command spells it; --output, its name before, still works
    p.add_argument("--out", "--output", dest="output", required=True, metavar="DIR",
                   help="the folder to write")


def prep_parser() -> argparse.ArgumentParser:
    p = command_line.Parser(prog="tupe-prep", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    defaults = PrepConfig(inputs=[], output="")
    p.add_argument("--input", nargs="+", required=True, dest="inputs", metavar="PATH",
                   help=".txt, .jsonl[.gz], .parquet files, folders of them, or a saved HF dataset")
    add_out_flag(p)
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--min-frequency", type=int, default=defaults.min_frequency,
                   help="BPE merges rarer than this are not learnt")
    p.add_argument("--workers", type=int, default=defaults.workers)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--dedup", choices=["exact", "minhash", "none"], default=defaults.dedup)
    p.add_argument("--jaccard-threshold", type=float, default=defaults.jaccard_threshold,
                   help="near-duplicate threshold of --dedup minhash")
    p.add_argument("--text-key", default=defaults.text_key, help="text field of JSON lines/parquet")
    p.add_argument("--txt-documents", choices=["blank-line", "file"], default=defaults.txt_documents,
                   help="in .txt files, documents are separated by blank lines, or one per file")
    p.add_argument("--tokenizer", metavar="FILE", help="encode with this tokenizer.json, train none")
    p.add_argument("--valid-fraction", type=float, default=defaults.valid_fraction,
                   help="fraction of documents (chosen by content hash) in valid.bin/.idx")
    p.add_argument("--min-words", type=int, default=defaults.min_words,
                   help="documents with fewer words after cleaning are dropped (and counted)")
    p.add_argument("--min-sentence-words", type=int, default=defaults.min_sentence_words,
                   help="shorter sentences are joined to the next one")
    p.add_argument("--spacy-model", default=defaults.spacy_model,
                   help="an installed spaCy pipeline; default: rule-based sentencizer")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed JSON lines and records without text")
    p.add_argument("--shard", type=shard, metavar="I/N",
                   help="process the I-th of N contiguous groups of input files (needs --tokenizer)"
                   ).joined_by = "/"
    p.add_argument("--dedup-against", nargs="+", default=(), metavar="DIR",
                   help="folders of tupe-prep (other corpora): documents found in them, exact or "
                        "near, are removed from this one")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    command_line.paths(p, "inputs", "output", "tokenizer", "dedup_against")
    return p


def merge_parser() -> argparse.ArgumentParser:
    p = command_line.Parser(prog="tupe-prep merge", allow_abbrev=False,
                                description="Merge shard outputs, removing duplicates across "
                                            "shards: exact ones, and near ones where the shards "
                                            "were prepared with --dedup minhash.")
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    p.add_argument("shards", nargs="+", metavar="SHARD_DIR")
    add_out_flag(p)
    p.add_argument("--dedup-against", nargs="+", default=(), metavar="DIR",
                   help="folders of tupe-prep (other corpora) whose documents are removed from "
                        "the merge, exact or near")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    command_line.paths(p, "output", "dedup_against")
    return p


def summary(manifest: dict) -> str:
    rows = [(key, manifest.get(key)) for key in (
        "documents_in", "empty_dropped", "short_dropped", "exact_duplicates_removed",
        "near_duplicates_removed", "cross_shard_exact_duplicates_removed",
        "cross_shard_near_duplicates_removed", "cross_corpus_exact_duplicates_removed",
        "cross_corpus_near_duplicates_removed", "invalid_utf8_lines",
        "bad_lines_skipped", "documents_out", "sentences", "tokens", "bytes_in", "vocab_size")
        if key in manifest]
    rows += [(f"{split} documents/tokens", f"{c['documents']:,} / {c['tokens']:,}")
             for split, c in manifest["splits"].items()]
    rows += [(f"seconds {stage}", value) for stage, value in manifest["seconds"].items()]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value:,}" if isinstance(value, int) else
             f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines + source_table(manifest.get("sources", {})))


SOURCE_COLUMNS = {"documents_in": "in", "empty_dropped": "empty", "short_dropped": "short",
                  "exact_duplicates_removed": "exact dup", "near_duplicates_removed": "near dup",
                  "cross_shard_exact_removed": "exact, shards", "cross_shard_near_removed":
                  "near, shards", "cross_corpus_exact_removed": "exact, corpora",
                  "cross_corpus_near_removed": "near, corpora", "documents_out": "out",
                  "sentences": "sentences", "tokens": "tokens"}


def source_table(sources: dict) -> list:
    """Per source (an input of tupe-prep, a shard of merge): documents in, what went and why
    (dropped empty or short, duplicates within the run, across shards, against other corpora),
    documents, sentences and tokens out; columns a manifest does not have are left out."""
    if not sources:
        return []
    columns = [c for c in SOURCE_COLUMNS if any(c in counts for counts in sources.values())]
    header = ["source", *(SOURCE_COLUMNS[c] for c in columns)]
    body = [[name, *(f"{counts.get(c, 0):,}" for c in columns)] for name, counts in
            sources.items()]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return ["", *("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                            for i, (cell, w) in enumerate(zip(row, widths)))
                  for row in [header, *body])]


def main(argv=None) -> int:
    return entry.run("tupe-prep", lambda: prep(argv), errors=(InputError,))


def prep(argv) -> int:
    """tupe-prep's work: the corpus prepared (or, `tupe-prep merge`, shards merged), and what it
    holds said."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "merge" in argv and set(argv[:argv.index("merge")]) <= {"--verbose", "--quiet",
                                                               "--print-config"}:
        argv.remove("merge")  # the command after flags of no value: `tupe-prep --verbose merge`
        argv.insert(0, "merge")
    try:
        if argv[:1] == ["merge"]:
            args = command_line.parse(merge_parser(), argv[1:])
            manifest = merge(args.shards, args.output, quiet=args.quiet,
                             dedup_against=args.dedup_against)
            output = args.output
        else:
            args = vars(command_line.parse(prep_parser(), argv))
            args["dedup_against"] = tuple(args["dedup_against"])
            for name in ("verbose", "config", "print_config"):  # read at import, or by parse
                del args[name]
            manifest = prepare(PrepConfig(**args))
            output = args["output"]
    except ValueError as error:  # here only: a ValueError of the summary is a bug, no refusal
        raise CommandRefused(str(error)) from None
    logger.info(summary(manifest))
    if manifest["splits"]["valid"]["documents"] == 0:
        logger.warning("warning: the valid split is empty (raise --valid-fraction for a validation "
                       "set)")
    logger.info(f"wrote {output}/{{train,valid}}.{{bin,idx}}, tokenizer.json, manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
