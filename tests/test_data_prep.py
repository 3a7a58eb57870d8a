"""data_prep: round trip, de-duplication, bad inputs, indexed outputs, shards and merge."""

import gzip
import json
import os
import random
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from data_prep.clean import Cleaner
from data_prep.cli import main
from data_prep.dedup import EXACT, KEPT, NEAR, Deduplicator, exact_key
from data_prep.merge import merge
from data_prep.near import shingle_hashes
from data_prep.output import WORK_DIR, work_folder
from data_prep.pipeline import PrepConfig, prepare
from data_prep.read import InputError
from tupe_ds.tools import lock

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "sample")
WORDS = ("time house river light garden letter morning friend answer window evening carriage "
         "sister fortune promise silence country manner journey family opinion moment").split()


def unique_document(rng, words=60):
    """A paragraph of a few sentences of random words: shares few 5-word shingles with others."""
    sentences = []
    while words > 0:
        length = min(words, rng.randint(6, 14))
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize() + ".")
        words -= length
    return " ".join(sentences)


def near_copy(text):
    """Two words of 200 changed: a Jaccard similarity of 5-word shingles of about 0.9."""
    words = text.split()
    for position in (50, 150):
        words[position] = "changed"
    return " ".join(words)


def write_txt(path, documents):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(documents) + "\n")
    return str(path)


def run(inputs, output, **options):
    options = {"workers": 1, "vocab_size": 400, "min_frequency": 1, "valid_fraction": 0.0,
               "quiet": True, **options}
    return prepare(PrepConfig(inputs=[str(p) for p in inputs], output=str(output), **options))


def documents_of(prefix, tokenizer):
    """The decoded sentences of each document of an indexed dataset."""
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[tokenizer.decode(dataset[i].tolist(), skip_special_tokens=False)
             for i in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


def test_round_trip_and_manifest_counts(tmp_path):
    documents = [
        "Mr. Darcy   walked in.\tShe said „hello“ - and left! Did he notice? No.",
        "Write to jane@example.org or see https://example.com/austen?id=3 for more text here.",
        "Ünïcödé ﬁne ligatures and full-width ＡＢＣ survive NFKC. Short. Sentences are joined.",
    ]
    source = write_txt(tmp_path / "in.txt", documents)
    manifest = run([source], tmp_path / "out", dedup="none", min_words=3)
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    decoded = documents_of(tmp_path / "out" / "train", tokenizer)
    cleaner = Cleaner()
    assert [" ".join(sentences) for sentences in decoded] == [cleaner.normalize(d)
                                                              for d in documents]
    assert "[EMAIL]" in decoded[1][0] and "[URL]" in decoded[1][0]
    assert all(len(s.split()) >= 4 for doc in decoded for s in doc)  # short ones were joined
    dataset = IndexedDataset(str(tmp_path / "out" / "train"))
    assert manifest["documents_in"] == manifest["documents_out"] == 3
    assert len(dataset) == manifest["sentences"] == sum(len(d) for d in decoded)
    assert int(dataset.sequence_lengths.sum()) == manifest["tokens"]
    assert len(dataset.document_indices) - 1 == manifest["splits"]["train"]["documents"] == 3
    assert dataset[0].dtype == np.uint16
    with open(tmp_path / "out" / "manifest.json") as f:
        on_disk = json.load(f)
    for key in ("documents_in", "documents_out", "empty_dropped", "exact_duplicates_removed",
                "near_duplicates_removed", "sentences", "tokens", "bytes_in", "seconds"):
        assert key in on_disk
    assert on_disk["bytes_in"] == os.path.getsize(source)
    assert Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).token_to_id("[PAD]") == 0


def test_exact_and_near_duplicates_are_removed_and_nothing_unique(tmp_path):
    rng = random.Random(0)
    originals = [unique_document(rng, words=200) for _ in range(30)]
    near = [near_copy(text) for text in originals[:5]]
    exact = [originals[7], originals[9], originals[7]]
    source = write_txt(tmp_path / "in.txt", originals + near + exact)
    manifest = run([source], tmp_path / "out", dedup="minhash")
    assert manifest["exact_duplicates_removed"] == 3
    assert manifest["near_duplicates_removed"] == 5
    assert manifest["documents_out"] == 30
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    kept = [" ".join(doc) for doc in documents_of(tmp_path / "out" / "train", tokenizer)]
    assert kept == [Cleaner().normalize(text) for text in originals]  # the first of each kept

    manifest = run([source], tmp_path / "exact", dedup="exact")
    assert (manifest["exact_duplicates_removed"], manifest["near_duplicates_removed"]) == (3, 0)
    assert manifest["documents_out"] == 35


PERSIAN = ("\u06a9\u062a\u0627\u0628\u200c\u0647\u0627 \u0631\u0627 "  # "the books", a ZWNJ
           "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645")  # "I want", a ZWNJ
FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # an emoji ZWJ sequence


@pytest.mark.parametrize("text, cleaned", [
    pytest.param("As\u200bsociation", "Association", id="zero-width space"),
    pytest.param("co\u00adoperation", "cooperation", id="soft hyphen"),
    pytest.param("word\u2060joiner", "wordjoiner", id="word joiner"),
    pytest.param("\ufeffA by\ufeffte order mark", "A byte order mark", id="BOM"),
    pytest.param("Paris\u200e, \u202aFrance\u202c and Ly\u2066o\u2069n", "Paris, France and Lyon",
                 id="bidi controls outside bidi text"),
    pytest.param("Z\u200dW\u200cJ", "ZWJ", id="joiners between Latin letters"),
    pytest.param("x\u2062y \U000e0074ag", "xy ag", id="invisible times, tag"),
])
def test_format_characters_without_meaning_go_and_leave_no_space(text, cleaned):
    assert Cleaner().normalize(text) == cleaned


@pytest.mark.parametrize("text", [
    pytest.param(PERSIAN, id="ZWNJ in Persian"),
    pytest.param("\u0915\u094d\u200d\u0937", id="ZWJ after a Devanagari virama"),
    pytest.param(FAMILY, id="ZWJ in an emoji sequence"),
    pytest.param("\U0001f3f3\ufe0f\u200d\U0001f308", id="ZWJ after an emoji variation selector"),
    pytest.param("\u05e9\u05dc\u05d5\u05dd\u200f (shalom)", id="RLM in bidi text"),
    pytest.param("\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
                 id="tags of England's flag"),
    pytest.param("\u0600\u0661\u0662 \u06dd\u0663", id="Arabic number sign, end of ayah"),
])
def test_format_characters_a_script_needs_stay(text):
    assert Cleaner().normalize(text) == text


def test_copies_differing_only_in_format_characters_are_exact_duplicates(tmp_path):
    """Issue 59: copies with a format character inside every fifth word split no word, and
    copies differing only in format characters, kept ones too, have the same key and shingles."""
    rng = random.Random(59)
    originals = [unique_document(rng) for _ in range(3)] + [f"{PERSIAN} {FAMILY} {PERSIAN}."]
    invisible = "\u200b\u00ad\u2060\ufeff\u200e\u200d\u200c\u2062"

    def hidden(text):
        return " ".join(word[:1] + invisible[i // 5 % len(invisible)] + word[1:] if i % 5 == 0
                        else word for i, word in enumerate(text.split()))

    copies = [hidden(text) for text in originals[:3]]
    copies.append(hidden(originals[3].replace("\u200c", "").replace("\u200d", "")))
    clean = Cleaner().normalize
    documents = [clean(text) for text in originals + copies]
    assert documents[4:7] == documents[:3]  # not a word split
    assert documents[7] != documents[3] and "\u200c" in documents[3]
    keys = [exact_key(text) for text in documents]
    assert Deduplicator("exact", folder=str(tmp_path)).judge(keys) == [KEPT] * 4 + [EXACT] * 4
    shingles = [shingle_hashes(text, 5).tolist() for text in documents]
    assert shingles[4:] == shingles[:4]


def assert_no_output(folder):
    left = set(os.listdir(folder)) if os.path.exists(folder) else set()
    assert not left & {"train.bin", "train.idx", "valid.bin", "valid.idx", "manifest.json",
                       "tokenizer.json"}, left
    assert not any(name.startswith(WORK_DIR) for name in left), left  # nor work folders


def work_left(folder):
    """The work folders, and their records, that runs left in `folder`."""
    return sorted(name for name in os.listdir(folder) if name.startswith(WORK_DIR))


def test_invalid_utf8_nul_and_empty_files(tmp_path):
    rng = random.Random(1)
    good = unique_document(rng)
    (tmp_path / "bad.txt").write_bytes(b"Broken \xff\xfe bytes in this line of text here.\n\n"
                                       b"A NUL\x00 byte sits in this other line of text.\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    manifest = run([write_txt(tmp_path / "good.txt", [good]), tmp_path / "bad.txt",
                    tmp_path / "empty.txt"], tmp_path / "out", min_words=3)
    assert manifest["invalid_utf8_lines"] == 1
    assert manifest["invalid_utf8_examples"] == [f"{tmp_path / 'bad.txt'}:1"]
    assert manifest["empty_files"] == [str(tmp_path / "empty.txt")]
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    text = " ".join(" ".join(d) for d in documents_of(tmp_path / "out" / "train", tokenizer))
    assert "\ufffd" in text and "\x00" not in text and "A NUL byte sits" in text

    with pytest.raises(InputError, match="no document left"):
        run([tmp_path / "empty.txt"], tmp_path / "nothing")
    assert_no_output(tmp_path / "nothing")


@pytest.mark.slow
def test_ten_megabyte_single_line(data, tmp_path):
    rng = random.Random(2)
    line = " ".join(unique_document(rng, words=30) for _ in range(8000))
    line = (line * (10_000_000 // len(line) + 1))[:10_000_000]
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": line}) + "\n")
    # the novel's tokenizer: the line read, cleaned, split and encoded, no BPE trained on it
    manifest = run([tmp_path / "long.jsonl"], tmp_path / "out", dedup="exact",
                   tokenizer=os.path.join(data, "tokenizer.json"))
    assert manifest["documents_out"] == 1 and manifest["sentences"] > 100_000
    assert manifest["bytes_in"] > 10_000_000


@pytest.mark.parametrize("line, message", [
    ('{"text": "fine"\n', r"bad.jsonl:2: malformed JSON"),
    ('{"body": "no text field"}\n', r"bad.jsonl:2: no string field 'text'"),
])
def test_bad_json_lines_fail_or_are_skipped(tmp_path, line, message):
    good = json.dumps({"text": unique_document(random.Random(3))}) + "\n"
    path = tmp_path / "bad.jsonl"
    path.write_text(good + line + good.replace("Time", "Light"))
    with pytest.raises(InputError, match=message):
        run([path], tmp_path / "out")
    assert_no_output(tmp_path / "out")
    manifest = run([path], tmp_path / "out", skip_bad_lines=True)
    assert manifest["bad_lines_skipped"] == 1 and manifest["documents_in"] == 2


def test_truncated_gzip_is_an_error_and_leaves_nothing(tmp_path, capsys):
    data = gzip.compress(("\n".join(json.dumps({"text": unique_document(random.Random(i))})
                                    for i in range(200)) + "\n").encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    assert main(["--input", str(path), "--output", str(tmp_path / "out"), "--quiet",
                 "--workers", "1"]) == 2
    assert f"{path}: truncated or corrupt gzip file" in capsys.readouterr().err
    assert_no_output(tmp_path / "out")


def test_a_crash_leaves_no_partial_output_and_a_rerun_finishes(tmp_path, monkeypatch):
    source = write_txt(tmp_path / "in.txt", [unique_document(random.Random(i)) for i in range(20)])
    import data_prep.write as pipeline

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_encode", crash)
    with pytest.raises(KeyboardInterrupt):
        run([source], tmp_path / "out")
    assert not {"train.bin", "train.idx", "manifest.json"} & set(os.listdir(tmp_path / "out"))
    monkeypatch.undo()
    manifest = run([source], tmp_path / "out")
    assert manifest["documents_out"] == 20
    assert not work_left(tmp_path / "out")


def test_a_run_works_in_a_folder_of_its_own_and_removes_it_when_it_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with work_folder(str(tmp_path)) as work:
            assert os.path.basename(work).startswith(
                f"{WORK_DIR}.{socket.gethostname()}.{os.getpid()}.")
            with open(f"{work}.holder", "rb") as record:
                assert lock.parse_holder(record.read())["pid"] == os.getpid()
            with open(os.path.join(work, "train.bin"), "wb") as half:
                half.write(b"half")
            raise RuntimeError("failed mid-way")
    assert not work_left(tmp_path)


def left_work(output, name, record):
    """A work folder with a file in it, as a run killed mid-way leaves it, and its run's record
    (bytes: a damaged one)."""
    os.makedirs(output / name)
    (output / name / "train.bin").write_bytes(b"half")
    if record is not None:
        (output / f"{name}.holder").write_bytes(
            record if isinstance(record, bytes) else json.dumps(record).encode())


def test_a_later_run_removes_the_work_folders_of_ended_runs_only(tmp_path, monkeypatch, capsys):
    """Runs on two nodes share OUTPUT where flock holds on one node only (Lustre's localflock):
    a run removes only the work folders whose run is gone by the lock holders' rules."""
    for name in lock.SLURM_FIELDS.values():
        monkeypatch.delenv(name, raising=False)
    here = {k: v for k, v in lock.this_holder().items()
            if k not in lock.SLURM_FIELDS}
    killed = subprocess.Popen(["sleep", "60"])
    killed_start = lock.process_start(killed.pid)
    killed.kill()
    killed.wait()
    left = {
        "killed": ({**here, "pid": killed.pid, "pid_start": killed_start},
                   "its process has ended"),
        "pid_reused": ({**here, "pid_start": here["pid_start"] + 1}, "its process has ended"),
        "damaged": (b'{"host": "node-b"', "damaged"),
        "requeued": ({**here, "host": "node-b", "slurm_job_id": "77",
                      "slurm_restart_count": "0"}, "this Slurm job (77) before it was requeued"),
        "running": (here, "a live process of this machine"),  # this test's process
        "elsewhere": ({**here, "host": "node-b"}, "may still be running on another machine"),
        "unrecorded": (None, "no record of the run that wrote it"),
    }
    for name, (record, _) in left.items():
        left_work(tmp_path, f"{WORK_DIR}.{name}", record)
    (tmp_path / WORK_DIR).mkdir()  # an earlier version's
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")

    kept = ["elsewhere", "running", "unrecorded"]
    with work_folder(str(tmp_path)) as work:
        own = os.path.basename(work)
        assert work_left(tmp_path) == sorted(
            [WORK_DIR, f"{WORK_DIR}.unrecorded", f"{WORK_DIR}.elsewhere",
             f"{WORK_DIR}.elsewhere.holder", f"{WORK_DIR}.running", f"{WORK_DIR}.running.holder",
             own, f"{own}.holder"])
    said = {line.split()[2].rstrip(",:"): line for line in capsys.readouterr().out.splitlines()}
    for name, (_, why) in left.items():
        line = said[str(tmp_path / f"{WORK_DIR}.{name}")]
        assert line.startswith(f"tupe-prep: {'left' if name in kept else 'removed'} ") \
            and why in line, line
    assert "no record" in said[str(tmp_path / WORK_DIR)]
    assert not os.path.exists(work)


def test_inputs_of_every_kind(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [unique_document(random.Random(i)) for i in range(4)]
    write_txt(tmp_path / "a.txt", texts[:1])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"content": texts[1]}) + "\n")
    pq.write_table(pa.table({"content": [texts[2]]}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"content": [texts[3]]}).save_to_disk(str(tmp_path / "d"))
    manifest = run([tmp_path / "a.txt", tmp_path / "b.jsonl.gz", tmp_path / "c.parquet",
                    tmp_path / "d"], tmp_path / "out", text_key="content")
    assert manifest["documents_out"] == 4


@pytest.mark.slow
def test_shards_merged_equal_one_run_with_the_same_tokenizer(tmp_path):
    rng = random.Random(4)
    documents = [unique_document(rng) for _ in range(40)]
    parts = [documents[i * 10:(i + 1) * 10] for i in range(4)]
    parts[2].append(documents[3])  # a document of part0 again: removed only by the merge
    files = [write_txt(tmp_path / f"part{i}.txt", part) for i, part in enumerate(parts)]
    tokenizer = run(files, tmp_path / "tok", dedup="exact")  # a tokenizer for every run
    options = dict(dedup="exact", valid_fraction=0.2,
                   tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    single = run(files, tmp_path / "single", **options)
    for index in range(2):
        run(files, tmp_path / f"shard{index}", shard=(index, 2), **options)
    merged = merge([str(tmp_path / "shard0"), str(tmp_path / "shard1")], str(tmp_path / "merged"),
                   quiet=True)
    assert merged["cross_shard_exact_duplicates_removed"] == 1
    assert merged["near_duplicates_across"] is False  # exact shards: no signatures
    for key in ("documents_out", "sentences", "tokens", "exact_duplicates_removed", "splits"):
        assert merged[key] == single[key], key
    for split in ("train", "valid"):
        one = IndexedDataset(str(tmp_path / "single" / split))
        two = IndexedDataset(str(tmp_path / "merged" / split))
        assert (one.document_indices == two.document_indices).all()
        assert (one.sequence_lengths == two.sequence_lengths).all()
        assert all((one[i] == two[i]).all() for i in range(len(one)))
    assert tokenizer["documents_out"] == 40


def test_bundled_sample_corpus_is_there():
    names = sorted(os.listdir(SAMPLE))
    assert "persuasion.txt.gz" in names and len(names) == 6


def test_configuration_errors_name_the_option(tmp_path, capsys):
    source = write_txt(tmp_path / "in.txt", ["some words here and there"])
    for argv, words in [
        (["--shard", "0/2"], "--shard: shards must share one tokenizer"),
        (["--shard", "3/2", "--tokenizer", source], "--shard: I/N needs 0 <= I < N"),
        (["--valid-fraction", "1.5"], "--valid-fraction: must be in [0, 1)"),
        (["--tokenizer", str(tmp_path / "missing.json")], "--tokenizer:"),
        (["--vocab-size", str(10**23)], "--vocab-size: 100000000000000000000000 is more than"),
        (["--min-frequency", "-1"], "--min-frequency: must be 0 or more, got -1"),
        (["--min-words", "-3"], "--min-words: must be 0 or more"),
        (["--min-sentence-words", "-2"], "--min-sentence-words: must be 0 or more"),
    ]:
        assert main(["--input", source, "--output", str(tmp_path / "out"), *argv]) == 2
        assert words in capsys.readouterr().err


def test_merge_is_the_command_after_flags_of_no_value_too(tmp_path, capsys):
    """`tupe-prep --quiet merge ...` is merge (an unrecognized 'merge' before); a folder named
    merge among --input stays an input."""
    with pytest.raises(SystemExit) as exit_:
        main(["--quiet", "--print-config", "merge", "--out", str(tmp_path / "m"), "s1"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    assert "quiet = true  # command line" in printed and "# tupe-prep merge" in printed[0]
    assert main(["--input", str(tmp_path / "merge"), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'merge'}" in capsys.readouterr().err


def kept_texts(folder):
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return [" ".join(doc) for split in ("train", "valid")
            for doc in documents_of(os.path.join(folder, split), tokenizer)]


@pytest.mark.slow
def test_near_duplicates_across_shards_and_corpora_go_the_first_copy_stays(tmp_path):
    """Shard 1 holds near-copies of 3 of shard 0's documents, and another corpus near-copies of
    3 more and an exact copy: the merge removes the first 3 from whichever shard comes later,
    --dedup-against removes the other corpus's 4 (from a run or a merge), and no unrelated
    document goes."""
    rng = random.Random(7)
    originals = [unique_document(rng, words=200) for _ in range(40)]
    clean = Cleaner().normalize
    files = [write_txt(tmp_path / "part0.txt", originals[:20]),
             write_txt(tmp_path / "part1.txt",
                       originals[20:] + [near_copy(t) for t in originals[:3]])]
    run(files, tmp_path / "tok", dedup="exact")
    options = dict(valid_fraction=0.2, tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    shards = [str(tmp_path / f"shard{i}") for i in range(2)]
    for index, shard in enumerate(shards):
        assert run(files, shard, shard=(index, 2), **options)["near_duplicates_removed"] == 0
    merged = merge(shards, str(tmp_path / "merged"), quiet=True)
    assert (merged["cross_shard_exact_duplicates_removed"],
            merged["cross_shard_near_duplicates_removed"]) == (0, 3)
    assert merged["near_duplicates_across"] and merged["documents_out"] == 40
    assert merged["sources"][shards[1]]["cross_shard_near_removed"] == 3
    assert sorted(kept_texts(tmp_path / "merged")) == sorted(clean(t) for t in originals)
    backwards = merge(shards[::-1], str(tmp_path / "backwards"), quiet=True)
    # now shard 1 comes first: it keeps the copies, one in its valid split whose original is in
    # shard 0's train split, as one run over the files in that order does
    one_run = run(files[::-1], tmp_path / "one-run", **options)
    assert kept_texts(tmp_path / "backwards") == kept_texts(tmp_path / "one-run")
    assert backwards["splits"] == one_run["splits"]
    assert backwards["sources"][shards[0]]["cross_shard_near_removed"] == 3

    others = [unique_document(rng, words=200) for _ in range(10)]
    other = write_txt(tmp_path / "other.txt", others + [near_copy(t) for t in originals[3:6]]
                      + [originals[10]])
    against = run([other], tmp_path / "other", dedup_against=(str(tmp_path / "merged"),),
                  **options)
    assert (against["cross_corpus_exact_duplicates_removed"],
            against["cross_corpus_near_duplicates_removed"]) == (1, 3)
    assert against["documents_out"] == 10
    assert sorted(kept_texts(tmp_path / "other")) == sorted(clean(t) for t in others)
    assert against["splits"]["train"]["documents"] + against["splits"]["valid"][
        "documents"] == 10
    run([other], tmp_path / "other-all", **options)
    again = merge(shards, str(tmp_path / "merged-against"), quiet=True,
                  dedup_against=[str(tmp_path / "other-all")])
    # the other corpus comes first now: shard 0 loses originals 3-5 (near) and 10 (exact)
    assert (again["cross_corpus_exact_duplicates_removed"],
            again["cross_corpus_near_duplicates_removed"]) == (1, 3)
    assert again["cross_shard_near_duplicates_removed"] == 3 and again["documents_out"] == 36


@pytest.mark.slow
def test_merging_a_merged_folder_removes_what_one_merge_removes(tmp_path, capsys):
    """merge(merge(a, b), c) == merge(a, b, c): the merged folder records its de-duplication
    settings and keeps every kept document's near-duplicate files; a folder without them is
    named when near duplicates cannot be removed across."""
    rng = random.Random(11)
    originals = [unique_document(rng, words=200) for _ in range(30)]
    parts = [originals[:10], originals[10:20] + [near_copy(t) for t in originals[:3]],
             originals[20:] + [near_copy(t) for t in originals[3:5] + originals[12:14]]]
    files = [write_txt(tmp_path / f"part{i}.txt", texts) for i, texts in enumerate(parts)]
    run(files, tmp_path / "exact", dedup="exact")
    options = dict(tokenizer=str(tmp_path / "exact" / "tokenizer.json"), valid_fraction=0.2)
    shards = [str(tmp_path / f"shard{i}") for i in range(3)]
    for file, shard in zip(files, shards):
        run([file], shard, **options)
    at_once = merge(shards, str(tmp_path / "abc"), quiet=True)
    first = merge(shards[:2], str(tmp_path / "ab"), quiet=True)
    then = merge([str(tmp_path / "ab"), shards[2]], str(tmp_path / "ab-c"), quiet=True)
    assert at_once["near_duplicates_removed"] == 7
    assert (first["near_duplicates_removed"], then["near_duplicates_removed"]) == (3, 7)
    assert then["near_duplicates_across"] and then["config"]["dedup"] == "minhash"
    assert sorted(kept_texts(tmp_path / "ab-c")) == sorted(kept_texts(tmp_path / "abc"))
    assert then["documents_out"] == at_once["documents_out"] == 30

    mixed = merge([shards[0], str(tmp_path / "exact")], str(tmp_path / "mixed"), quiet=True)
    assert not mixed["near_duplicates_across"]
    assert f"{tmp_path / 'exact'} had no --dedup minhash" in capsys.readouterr().err


def test_two_novels_share_no_near_duplicate(data, tmp_path):
    """False positives on text with none planted: another novel de-duplicated against the first
    (thousands of paragraphs each) loses nothing."""
    other = run([os.path.join(SAMPLE, "northangerabbey.txt.gz")], tmp_path / "other",
                dedup_against=(data,), tokenizer=os.path.join(data, "tokenizer.json"))
    assert other["documents_out"] > 500
    assert (other["cross_corpus_exact_duplicates_removed"],
            other["cross_corpus_near_duplicates_removed"]) == (0, 0)


def test_band_keys_differ_only_in_the_band_of_a_changed_value():
    from data_prep.near import band_keys, lsh_shape

    bands, rows = lsh_shape(0.8, 128)
    assert (bands, rows) == (18, 7)
    signatures = np.random.default_rng(0).integers(0, 2**32, size=(2, 128), dtype=np.uint32)
    signatures[1] = signatures[0]
    signatures[1, 3 * rows + 2] += 1  # one value of band 3 differs
    keys = band_keys(signatures, bands, rows, chunk=1)
    assert (keys[:, 0] == keys[:, 1]).tolist() == [band != 3 for band in range(bands)]


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.8, 0.9, 0.95])
def test_lsh_shape_finds_pairs_at_the_threshold_with_the_fewest_bands(threshold):
    from data_prep.near import RECALL_AT_THRESHOLD, lsh_shape

    def found(rows):
        return 1 - (1 - threshold ** rows) ** (128 // rows)

    bands, rows = lsh_shape(threshold, 128)
    assert bands == 128 // rows and found(rows) >= RECALL_AT_THRESHOLD > found(rows + 1)


def test_jaccards_of_many_pairs_at_once_equal_the_sets():
    from data_prep.near import jaccards

    rng = np.random.default_rng(3)
    sets = [np.unique(rng.integers(0, 60, size=rng.integers(0, 40))).astype(np.uint32)
            for _ in range(200)]
    pairs = [(sets[i], sets[j]) for i, j in rng.integers(0, 200, size=(300, 2))]
    got = jaccards((np.concatenate([a for a, _ in pairs]), [len(a) for a, _ in pairs]),
                   (np.concatenate([b for _, b in pairs]), [len(b) for _, b in pairs]))
    want = [len(set(a) & set(b)) / max(1, len(set(a) | set(b))) for a, b in pairs]
    assert np.allclose(got, want)


def test_the_bench_signs_pages_as_prep_does():
    from bench.dedup_across import signatures
    from data_prep.near import shingle_hashes, signature

    hashes = shingle_hashes(unique_document(random.Random(1), words=80), 5)
    assert (signatures(hashes[None])[0] == signature(hashes, 128)).all()


def web_pages(folder, documents, shards, planted=0.1):
    """bench/dedup_across.py's web-like shards: every page of 1 template's 120-shingle block
    and 20 of its own (pairwise Jaccard 0.75, one LSH bucket of thousands per band), and
    near-copies of shard 0's pages at Jaccard 0.6-0.95 planted in the later shards."""
    from bench import dedup_across

    dedup_across.make(SimpleNamespace(documents=documents, shards=shards, boilerplate=120,
                                      templates=1, slots=0, slot_values=1, unique=20,
                                      planted=planted, seed=0,
                                      levels=list(dedup_across.LEVELS), folder=str(folder)))
    return dedup_across


def assert_precise_at_the_threshold(result):
    """Nothing below the threshold removed; at 0.85 and above, 95% or more."""
    assert result["unplanted_removed"] == 0
    for level, (removed, planted) in result["by_level"].items():
        if float(level) < 0.8:
            assert removed == 0, (level, removed, planted)
        elif float(level) >= 0.85:
            assert removed >= 0.95 * planted, (level, removed, planted)


@pytest.mark.slow
def test_pages_sharing_a_block_are_kept_and_their_near_copies_removed(tmp_path, monkeypatch):
    """Across shards and within one run, over buckets of thousands: exact at the threshold, and
    each page checks a bounded number of candidates (the old LSH compared each page with its
    whole bucket and removed 54% of such pages)."""
    from data_prep import across, near

    bench = web_pages(tmp_path, documents=4000, shards=2)
    checked = []

    def to_verify(document, *args):
        chosen = near.to_verify(document, *args)
        checked.append(np.bincount(document[chosen]).max(initial=0))
        return chosen

    monkeypatch.setattr(across, "to_verify", to_verify)
    assert_precise_at_the_threshold(bench.measure(str(tmp_path), 2))
    assert max(checked) == near.VERIFIED_PER_DOCUMENT  # a bucket of thousands, 8 checked
    assert_precise_at_the_threshold(bench.measure_within(str(tmp_path)))


def test_a_templated_pages_copy_is_found_through_its_templates_full_buckets(tmp_path):
    """20 pages of one template (a 120-shingle block and 20 of their own: pairwise Jaccard
    0.75) fill its buckets, then a page P, then its copy C at Jaccard 0.87 that shares with P
    only the template's bands: C goes within one run, P being among the buckets' earliest
    WITHIN_RUN_CANDIDATES_PER_BUCKET (at 8, the earliest 8 siblings were C's only candidates)."""
    from data_prep.near import band_keys, lsh_shape, signature

    rng = np.random.default_rng(0)
    block = rng.integers(0, 2**32, 120, dtype=np.uint32)
    siblings = [np.unique(np.concatenate([block, rng.integers(0, 2**32, 20, dtype=np.uint32)]))
                for _ in range(21)]
    page = siblings.pop()
    shape = lsh_shape(0.8, 128)
    bands = band_keys(np.stack([signature(s, 128) for s in siblings + [page]]), *shape)
    while True:  # a copy that shares bands with P, but only those its siblings share
        copy = np.unique(np.concatenate([block, np.setdiff1d(page, block)[:10],
                                         rng.integers(0, 2**32, 10, dtype=np.uint32)]))
        shared = band_keys(signature(copy, 128)[None], *shape)[:, 0] == bands[:, -1]
        if shared.any() and (bands[shared, :1] == bands[shared, -1:]).all():
            break
    pages = siblings + [page, copy]
    dedup = Deduplicator("minhash", 0.8, 128, str(tmp_path))
    verdicts = dedup.judge(list(range(len(pages))), np.stack([signature(p, 128) for p in pages]),
                           pages)
    assert verdicts == [KEPT] * 21 + [NEAR]


def hand_made_part(prefix, sets):
    """A prepared split of documents given as sets of shingle hashes (keys, signatures,
    shingles, LSH index, as tupe-prep writes them)."""
    from data_prep import across, band_index
    from data_prep.near import signature, write_shingles

    hashes = [np.array(sorted(s), np.uint32) for s in sets]
    np.save(f"{prefix}.keys.npy", np.arange(len(sets), dtype=np.uint64) + hash(prefix) % 2**40)
    signatures = np.stack([signature(h, 128) for h in hashes])
    np.save(f"{prefix}.minhash.npy", signatures)
    write_shingles(str(prefix), hashes, sum(map(len, hashes)), len(hashes))
    band_index.write_band_index(str(prefix), signatures, 0.8, 128)
    return across.Part(str(prefix))


def test_a_buckets_heads_span_the_merged_parts_read_from_their_stored_indexes(tmp_path):
    """One page in a fixed part (10 copies) and in merged parts A (5), B (5) and C (1): C's
    copy gets, in every band, the 8 earliest of the fixed part and the 8 earliest of A then B
    together, all read from the parts' memory-mapped indexes (none held in memory)."""
    from data_prep import across, band_index

    page = set(range(200))
    parts = [hand_made_part(tmp_path / name, [page] * count)
             for name, count in (("fixed", 10), ("a", 5), ("b", 5), ("c", 1))]
    parts[0].fixed = True
    offsets = np.array([0, 10, 15, 20, 21])
    tables = band_index.BandTables(parts, offsets, 0.8, 128)
    assert all(isinstance(index, np.memmap) for group in tables.groups
               for table in group for index in table[:2])
    queries = across.band_keys(parts[3].signatures(), *tables.shape)
    _, heads = tables.candidates(queries, 20, np.zeros(21, dtype=bool))
    assert sorted(heads) == sorted([*range(8), *range(10, 18)] * tables.shape[0])


@pytest.mark.slow
def test_removed_documents_take_no_place_among_a_buckets_candidates(tmp_path):
    """30 documents W, each removed as a near-copy of one of A's, fill the buckets they share
    with Y (J(W, Y) = 0.995) before Y; X is a near-copy of Y (0.95) and of no kept one else: it
    goes in one merge as in a merge of the merge (a removed document is no bucket head)."""
    from data_prep import across, near

    y = set(range(400))
    w = [(y - {i}) | {1000 + i} for i in range(30)]
    a = [(w[i] - set(range(300, 344))) | set(range(5000 + 100 * i, 5044 + 100 * i))
         for i in range(30)]
    x = (y - set(range(390, 400))) | set(range(2000, 2010))
    first = hand_made_part(tmp_path / "a", a)
    # only the W that A's near-copies remove, each tried after A alone: after A and the other W,
    # all removed (no bucket heads), its candidates are the same A's heads
    alone = [hand_made_part(tmp_path / f"w{i}", [w[i]]) for i in range(30)]
    crowd = [i for i in range(30) if across.duplicates([first, alone[i]], 0.8, 128)[1].near[0]]
    parts = [alone[i] for i in crowd]
    assert len(crowd) > near.CANDIDATES_PER_BUCKET
    parts = [first, *parts, hand_made_part(tmp_path / "y", [y]),
             hand_made_part(tmp_path / "x", [x])]
    removed = across.duplicates(parts, 0.8, 128)
    assert all(r.near[0] for r in removed[1:-2])
    assert not removed[-2].near[0] and removed[-1].near[0]
    kept = [s for sets, r in zip([a, *([w[i]] for i in crowd), [y]], removed) for s, gone in
            zip(sets, r.any) if not gone]
    again = across.duplicates([hand_made_part(tmp_path / "merged", kept), parts[-1]], 0.8, 128)
    assert again[1].near[0]


def test_dedup_against_at_other_settings_and_wordless_documents(tmp_path):
    """--dedup-against a corpus prepared at another threshold is refused (the LSH bands would
    never meet); documents without a word share no shingle, so none is a near-copy of another."""
    texts = [unique_document(random.Random(5), words=120)]
    source = write_txt(tmp_path / "a.txt", texts)
    run([source], tmp_path / "a94", jaccard_threshold=0.94)
    with pytest.raises(ValueError, match="different --jaccard-threshold"):
        run([source], tmp_path / "b95", jaccard_threshold=0.95,
            dedup_against=(str(tmp_path / "a94"),),
            tokenizer=str(tmp_path / "a94" / "tokenizer.json"))
    # a folder tupe-prep did not write (raw text, a typo) is named as such, before any work
    for folder in (tmp_path, tmp_path / "no-such-folder"):
        with pytest.raises(ValueError, match=f"--dedup-against: {folder}: no manifest.json; name "
                           "folders written by tupe-prep"):
            run([source], tmp_path / "c", dedup_against=(str(folder),))
    symbols = ["| --- | --- | --- | --- |", "*** *** *** *** *** ***", "→ ← ↑ ↓ ↔ ↕",
               "!!! ??? ... ;;; ,,,"]
    manifest = run([write_txt(tmp_path / "s.txt", symbols + texts)], tmp_path / "s",
                   min_words=1)
    assert manifest["near_duplicates_removed"] == 0 and manifest["documents_out"] == 5


@pytest.mark.slow
def test_two_merges_into_one_folder_take_turns_and_a_damaged_file_is_named(tmp_path, capfd):
    """Two merge commands into one folder, one --quiet, take turns; the other shows its
    progress on stderr. Then a damaged shard's file is named."""
    rng = random.Random(9)
    shards = []
    for i in range(2):
        source = write_txt(tmp_path / f"{i}.txt", [unique_document(rng, words=80)
                                                   for _ in range(6)])
        run([source], tmp_path / f"shard{i}", tokenizer=None if i == 0 else
            str(tmp_path / "shard0" / "tokenizer.json"))
        shards.append(str(tmp_path / f"shard{i}"))
    merged = str(tmp_path / "merged")
    # the one with progress in a process of its own, its stderr a pipe; the --quiet one in this
    # process (one start fewer), begun at the other's first line, its near duplicates' progress,
    # written while it merges and holds the folder's lock
    shown = subprocess.Popen([sys.executable, "-m", "data_prep", "merge", "--out", merged,
                              *shards], stderr=subprocess.PIPE, text=True)
    first_line = shown.stderr.readline()
    capfd.readouterr()
    quiet = main(["merge", "--quiet", "--output", merged, *shards[::-1]])
    said = [first_line + shown.communicate(timeout=120)[1], capfd.readouterr().err]
    assert [shown.returncode, quiet] == [0, 0], said
    assert json.loads((tmp_path / "merged" / "manifest.json").read_text())["documents_out"] == 12
    # the de-duplication's and the copy's progress, with totals and rates; none with --quiet
    for stage in ("near duplicates", "merge train"):
        assert re.search(rf"^{stage}: 12/12 docs \(100%\), +[0-9.]+ docs/s, ", said[0],
                         re.MULTILINE), said[0]  # a pipe: plain lines (progress_bar.py)
    assert [line for line in said[1].splitlines() if not line.startswith("warning:")] == []

    shingles = tmp_path / "shard1" / "train.shingles.npy"
    shingles.write_bytes(shingles.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"{tmp_path / 'shard1' / 'train'}: a near-duplicate "
                                         "file cannot be read"):
        merge(shards, str(tmp_path / "again"), quiet=True)
