"""tupe_ds's log lines (tupe_ds/tools/log_lines.py): information on stdout, warnings and errors on
stderr, rank 0's lines alone but each rank's own, and a stream that breaks said once."""

import io
import json
import logging
import tomllib

import pytest

from runs import CPU_CONFIG
from tupe_ds.tools import log_lines
from tupe_ds.train.config import load

logger = logging.getLogger("tupe_ds.test")


def test_information_goes_to_stdout_and_warnings_to_stderr_as_each_rank_should(capsys):
    log_lines.show(rank=0)
    logger.info("step 1")
    logger.warning("took over")
    assert capsys.readouterr() == ("step 1\n", "took over\n")
    log_lines.show(rank=1)
    logger.info("step 1")
    logger.warning("rank 0's warning")
    logger.warning("its own", extra=log_lines.EVERY_RANK)
    logger.error("failed")
    assert capsys.readouterr() == ("", "rank 1: its own\nrank 1: failed\n")


def test_a_stdout_that_breaks_is_said_once_and_the_run_goes_on(capfd, monkeypatch):
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    log_lines.show(rank=0)
    monkeypatch.setattr("sys.stdout", Closed())
    for step in range(3):
        logger.info(f"step {step}")
    logger.warning("still said")
    said = capfd.readouterr().err
    assert said == ("tupe_ds: stdout cannot be written ([Errno 32] Broken pipe): its lines are no "
                    "longer shown\nstill said\n")  # no traceback per line


def test_print_config_stays_a_config_file_when_the_run_folder_warns(data, tmp_path, capsys):
    """A run folder of an earlier tupe_ds: its warning goes to stderr, the file to stdout."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps(
        {"objective": "mlm", "data": data, "tp": 1, "pp": 1, "models": [{}], "settings": {}}))
    with pytest.raises(SystemExit) as ended:
        load(["--data", data, "--ds-config", CPU_CONFIG, "--out", str(out), "--model", "tiny",
              "--steps", "6", "--print-config"])
    assert ended.value.code == 0
    printed = capsys.readouterr()
    assert tomllib.loads(printed.out)["steps"] == 6
    assert "holds the settings of a run of a tupe_ds before 2026-11-29" in printed.err


def test_a_command_shows_its_lines_as_its_launchers_rank_before_discovery():
    from tupe_ds.tools.entry import launcher_rank

    assert launcher_rank({}) == 0 and launcher_rank({"RANK": "1", "SLURM_PROCID": "3"}) == 1
    assert launcher_rank({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}) == 3
    assert launcher_rank({"SLURM_PROCID": "3"}) == 0  # the batch script, not a task of a step
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "2"}) == launcher_rank({"PMI_RANK": "2"}) == 2


@pytest.mark.slow
def test_a_command_with_stdout_closed_runs_quietly_and_leaves_a_scripts_own_logger(tmp_path):
    """Information lines with stdout closed (>&-) are dropped, as print drops them; a reader of
    stdout that ends (| head -1) ends the command quietly; with stderr closed, an error line is
    not said on stdout; a script that calls a command keeps its own __main__ logger, while
    `python -m` one of ours shows it."""
    import subprocess
    import sys

    script = tmp_path / "user.py"
    script.write_text(
        "import logging, sys\n"
        f"logging.basicConfig(filename={str(tmp_path / 'my.log')!r}, level=logging.INFO)\n"
        "from tupe_ds.tools import entry\n"
        "work = lambda: logging.getLogger('tupe_ds.t').info('ours') or 0\n"
        "code = entry.run('x', work)\n"
        "logging.getLogger(__name__).info('theirs')\n"
        "sys.exit(code)\n")
    ran = subprocess.run(["bash", "-c", f"{sys.executable} {script} >&-"], capture_output=True,
                         text=True, timeout=120)
    assert (ran.returncode, ran.stderr) == (0, "")
    assert "theirs" in (tmp_path / "my.log").read_text()
    code = ("import sys\nfrom tupe_ds.tools import entry\nfrom tupe_ds.tools.errors import "
            "CommandRefused\ndef work():\n    print('flag\\n' * 100000)\n    raise "
            "CommandRefused('late')\nsys.exit(entry.run('x', work))\n")
    ran = subprocess.run(["bash", "-c", f"{sys.executable} -c \"{code}\" | head -1; exit "
                          "${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120)
    assert (ran.returncode, ran.stdout, ran.stderr) == (1, "flag\n", "")  # no traceback
    ran = subprocess.run(["bash", "-c", f"{sys.executable} -c \"{code}\" >/dev/null 2>&-"],
                         capture_output=True, text=True, timeout=120)
    assert (ran.returncode, ran.stdout, ran.stderr) == (2, "", "")  # not said on stdout
    (tmp_path / "a.txt").write_text("A sentence of the corpus. Another one follows it.\n" * 40)
    ran = subprocess.run([sys.executable, "-m", "data_prep.cli", "--input", str(tmp_path / "a.txt"),
                          "--vocab-size", "300", "--out", str(tmp_path / "prep"), "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and f"wrote {tmp_path / 'prep'}/" in ran.stdout, ran.stderr
