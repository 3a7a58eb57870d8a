"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, a copy with
a broken link, an unknown anchor or a page missing from the navigation fails to, and the commands
of the getting-started page run as written.

Only the ```bash blocks of docs/getting-started.md are run, one command (line) at a time, in order,
in the repository, with DEMO_STEPS=30 so that `make demo` stays short and DEMO_OUT in the test's
own folder (a user's build/demo-run is left alone); commands shown inline or in ```console or
```text blocks are not run.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
BUILD_TIMEOUT_S = 120
COMMAND_TIMEOUT_S = 600  # each command of the getting-started page
DEMO_STEPS = "30"


def mkdocs_build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of config_dir/mkdocs.yml into site_dir; output in .stdout."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(config_dir / "mkdocs.yml"), "--site-dir", str(site_dir)],
        cwd=config_dir, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S)


def test_nothing_in_the_repository_cites_a_file_outside_it():
    """Figures measured elsewhere are copied into the repository (bench/results/) with their date
    and commit, so that a clone holds every source its docs and scripts cite."""
    outside = "../" + "shared/"  # written in two, so that this file does not hold it
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    citing = [name for name in filter(None, tracked)
              if (ROOT / name).is_file() and outside.encode() in (ROOT / name).read_bytes()]
    assert not citing


def test_site_builds_strict(tmp_path):
    built = mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout
    for page in ("index.html", "getting-started/index.html", "benchmarks/index.html",
                 "search/search_index.json"):
        assert (tmp_path / "site" / page).is_file(), page


def break_link(docs: Path):
    with open(docs / "getting-started.md", "a") as f:
        f.write("\nSee [the old page](no-such-page.md).\n")


def break_anchor(docs: Path):
    with open(docs / "getting-started.md", "a") as f:
        f.write("\nSee [a section](model.md#no-such-section).\n")


def remove_page(docs: Path):
    (docs / "model.md").unlink()


@pytest.mark.parametrize("damage, named", [(break_link, "no-such-page.md"),
                                           (break_anchor, "#no-such-section"),
                                           (remove_page, "model.md")])
def test_strict_build_fails_on_broken_docs(tmp_path, damage, named):
    """The same site with one thing broken: the strict build fails and names it."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "README.md", tmp_path / "bench")  # docs/benchmarks.md reads it
    assert mkdocs_build(tmp_path, tmp_path / "site").returncode == 0
    damage(tmp_path / "docs")
    built = mkdocs_build(tmp_path, tmp_path / "site")
    assert built.returncode != 0, built.stdout
    assert named in built.stdout


def bash_commands(markdown: str) -> list:
    """The commands of the ```bash blocks, in order: one per line, backslash continuations
    joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, re.S | re.M):
        commands += [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    return commands


def run_command(command: str, demo_out: Path) -> str:
    """Run one command of the page in the repository; its output (stdout and stderr)."""
    env = {**os.environ, "DEMO_STEPS": DEMO_STEPS, "DEMO_OUT": str(demo_out)}
    with subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher's ranks too
            output, _ = process.communicate()
            pytest.fail(f"{command!r} ran past {COMMAND_TIMEOUT_S} s:\n{output[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"{command!r} exited {process.returncode}:\n{output[-4000:]}")
    return output


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo") / "run"


@pytest.fixture(scope="module")
def getting_started_output(demo_out) -> dict:
    """{command: its output (stdout and stderr)} for every command of the getting-started page's
    ```bash blocks, run once, in order; a command that fails or runs past COMMAND_TIMEOUT_S fails
    the tests that use this. The key is the command without its comment, e.g. "make demo":
    assertions on what a command prints go in tests of their own that take this fixture."""
    return {re.sub(r"\s+#.*$", "", command): run_command(command, demo_out)
            for command in bash_commands(GETTING_STARTED.read_text())}


@pytest.mark.slow
def test_getting_started_commands_run(getting_started_output, demo_out):
    assert "make demo" in getting_started_output  # the page still shows it
    demo = getting_started_output["make demo"]
    assert f"--logdir {demo_out}/tensorboard" in demo
    assert demo.count("--logdir") == 1 and "valid/accuracy 0" not in demo  # one of each
    # what the model learned, as the report states it (30 steps learn word frequencies at most)
    assert re.search(r"Accuracy at the \[MASK\] positions only \(\d+ masks in \d+ held-out "
                     r"samples\): the model 0\.\d+, the unigram guess \(always '.+', the most "
                     r"frequent token of the training split\) 0\.\d+: \d+\.\dx", demo)
    assert len(re.findall(r"    true '\w+'   model: rank \d+, p [\d.e-]+   unigram: rank \d+, "
                          r"p [\d.e-]+\n    the model's top 3: '.*' 0\.\d\d, '.*' 0\.\d\d, "
                          r"'.*' 0\.\d\d", demo)) == 3
    assert "Apex" not in demo and "Traceback" not in demo
