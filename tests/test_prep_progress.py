"""tupe-prep's progress on stderr: one bar at a time (pass 1's tqdm bar and the BPE trainer's
own bars were drawn over each other on a terminal), none with --quiet; --out, with --output as
its alias. The merge's progress: tests/test_data_prep.py, where merges run as commands."""

import itertools
import os
import random
import re
import subprocess
import sys

import pytest

from data_prep.cli import main, merge_parser, prep_parser
from terminal import on_a_terminal
from test_data_prep import unique_document, write_txt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SMALL_RUN = ["--workers", "1", "--vocab-size", "400", "--min-frequency", "1",
             "--valid-fraction", "0.5"]  # a valid split, so no warning that it is empty


def stderr_on_a_terminal(argv: list, timeout: float = 120) -> str:
    """What `python -m data_prep ARGV` writes to its stderr when that is a terminal (a
    pseudo-terminal of 120 columns): the trainer's bars (indicatif) are drawn only there."""
    return on_a_terminal([sys.executable, "-m", "data_prep", *argv], 120, cwd=ROOT,
                         stdout_too=False, timeout=timeout)


def bars_drawn(stderr: str) -> list:
    """The names of the bars (and notes) on `stderr`, in the order drawn, a name once for each
    stretch of its frames: tqdm's "NAME: 12 docs [...]" and indicatif's "[00:00:01] NAME  ██"."""
    frames = [frame.strip() for frame in re.split(r"[\r\n]", ANSI_ESCAPE.sub("", stderr))]
    names = [re.split(r":\s|\s{2,}", re.sub(r"^\[[\d:]+\]\s*", "", frame))[0]
             for frame in frames if frame]
    return [name for name, _ in itertools.groupby(names)]


@pytest.mark.slow
def test_pass_one_draws_one_bar_at_a_time_on_a_terminal(tmp_path):
    """Pass 1's bar counts the documents fed to the BPE trainer while the trainer counts their
    words: the trainer's own bars stay off, and its last step (the merges) is said in a line."""
    source = write_txt(tmp_path / "in.txt", [unique_document(random.Random(i)) for i in range(30)])
    said = stderr_on_a_terminal(["--input", source, "--out", str(tmp_path / "out"), *SMALL_RUN])
    assert bars_drawn(said) == ["clean, dedup, split", "BPE", "encode"], said
    assert "encode: 100%" in said and "docs/s]" in said
    assert os.path.exists(tmp_path / "out" / "manifest.json")


def test_quiet_draws_nothing(tmp_path, capfd):
    source = write_txt(tmp_path / "in.txt", [unique_document(random.Random(i)) for i in range(30)])
    assert main(["--input", source, "--output", str(tmp_path / "out"), "--quiet", *SMALL_RUN]) == 0
    assert capfd.readouterr().err == ""


def test_out_is_the_folder_flag_and_output_its_alias():
    for parser, required in ((prep_parser(), ["--input", "corpus/"]), (merge_parser(), ["a/"])):
        assert "--out DIR, --output DIR" in parser.format_help()
        for flag in ("--out", "--output"):
            assert parser.parse_args([*required, flag, "prep/"]).output == "prep/"


@pytest.mark.slow
def test_in_a_file_each_bar_is_a_plain_line_with_its_rate_and_time_left(tmp_path):
    """stderr to a file (a Slurm log): no carriage return, a line per TUPE_DS_PROGRESS_SECONDS
    and one at each bar's end, with the count, the rate and the time left."""
    source = write_txt(tmp_path / "in.txt", [unique_document(random.Random(i)) for i in range(30)])
    log = tmp_path / "prep.log"
    with open(log, "w") as f:
        ran = subprocess.run([sys.executable, "-m", "data_prep", "--input", source, "--out",
                              str(tmp_path / "out"), *SMALL_RUN], cwd=ROOT, stdout=f, stderr=f,
                             env={**os.environ, "TUPE_DS_PROGRESS_SECONDS": "0"}, timeout=300)
    said = log.read_text()
    assert ran.returncode == 0, said
    assert "\r" not in said
    elapsed = r"(?:[0-9]+:)?[0-9]{2}:[0-9]{2} elapsed"  # tqdm's clock, whatever it reads
    assert re.search(rf"^clean, dedup, split: 30 docs, [0-9.]+ docs/s, {elapsed}$", said,
                     re.MULTILINE), said
    assert re.search(rf"^encode: ([0-9]+)/\1 docs \(100%\), [0-9.]+ docs/s, {elapsed}, "
                     r"00:00 left$", said, re.MULTILINE), said
