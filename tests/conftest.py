import collections
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# a read that fails, or a file a manifest lists that is not there, is retried this long before
# the run stops (or counts the file missing): 120 s by default, which every damaged-file test
# (and every Hypothesis example of one) would wait out (tupe_ds/train/checkpoint/reads.py)
os.environ.setdefault("TUPE_DS_READ_RETRY_SECONDS", "1")
# One torch thread in every process of the suite: the commands run in-process (share_cpu_cores,
# tupe_ds/distributed/parallel.py, gives a process of its own every core unless this says) and
# the processes the tests start (torchrun sets 1; sbatch and the deepspeed launcher pass this on)
# share the 2 cores with the other xdist processes' tests. A tupe-finetune run in a test once left
# its worker with 2 threads: the next file's 800 AdamW steps (test_hf_export.py) took 244 CPU
# seconds there, 61 with one (2026-12-03).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the libraries' compile decorations deferred, as in a command (test_compile.py checks it); a
# reference setting left exported by a benchmark is no setting of the tests
os.environ.pop("TUPE_DS_COMPILE_AT_IMPORT", None)
# the tests' helpers (runs, workers, the Slurm cluster), imported by name as the workers, which
# run as scripts from there, import each other
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import pytest  # noqa: E402
import torch  # noqa: E402

import tupe_ds  # noqa: E402
from tupe_ds.tools import log_lines, third_party_warnings  # noqa: E402

# `make test` runs the files in 3 processes (pytest-xdist, -n 3; the suite's tests wait on the
# processes they start, so 3 keep 2 cores busier than 2 do): each file whole in one of them,
# so that a file's module fixtures (a reference run, a Slurm cluster) are made once; the files
# that start Slurm clusters in one, one after the other (FileScheduling below).
ONE_AT_A_TIME = {"test_slurm.py": "slurm", "test_multinode.py": "slurm"}


def pytest_configure(config):
    """The warnings tupe_ds's commands filter (third_party_warnings.QUIETED), filtered in the
    tests too, where pytest's own filters replace the ones the commands install at import; the
    tests' own, each naming its source, are setup.cfg's."""
    for quieted in third_party_warnings.QUIETED:
        if not quieted.logger:
            config.addinivalue_line("filterwarnings",
                                    f"ignore:{quieted.message}::{quieted.origin}")


@pytest.fixture(autouse=True)
def log_lines_as_a_command_shows_them():
    """tupe_ds's log lines on stdout as tupe-pretrain's rank 0 shows them (tools/log_lines.py),
    where capsys reads them; again for each test, as a test may have shown them as another
    rank."""
    log_lines.show(rank=0)


# One torch thread for in-process work (torch may have been imported before OMP_NUM_THREADS was
# set above), under xdist (the other processes' tests run beside this one's) and without it (the
# processes the tests start share the cores). With two, 60 AdamW steps of the tiny model took
# 26-49 s where one core was busy, 4.6 s with one (test_hf_export.py's pretraining, 2-core CPU,
# 2026-11-26); a 60-step fine-tune trial 45 s of CPU with two threads on a loaded machine, 2.3 s
# with one (2026-12-02).
torch.set_num_threads(1)


def work_unit(nodeid: str) -> str:
    """The tests one xdist process runs together: a file's, or the Slurm files'."""
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return ONE_AT_A_TIME.get(name, name)


# Fixtures that train or start processes (a reference run, a Slurm cluster, a demo): a test that
# uses one is slow, whatever its own time.
SLOW_FIXTURES = {"cluster", "prep_arrays", "two_nodes", "references", "reference", "constant_lr",
                 "two_stage_steps", "runs", "dp2_run", "finished", "tp2_results", "suite_run",
                 "topic_data", "demo_out", "getting_started_output", "stopped_on_a_full_log",
                 "electra_run", "one_rank", "layouts", "killed_comparison", "failing_runs",
                 "trained_runs", "imported_first"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The Slurm files first, the one unit made of two files; then the unit with the most slow
    # tests, which, handed out last as collected, ended the suite alone; the rest as collected,
    # each to whichever process is free (no durations kept: docs/development.md, "Tiers")
    slow = collections.Counter(work_unit(item.nodeid) for item in items
                               if item.get_closest_marker("slow"))
    most = max(slow, key=lambda unit: (unit not in ONE_AT_A_TIME.values(), slow[unit]),
               default=None)
    items.sort(key=lambda item: (work_unit(item.nodeid) not in ONE_AT_A_TIME.values(),
                                 work_unit(item.nodeid) != most))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """For `-n N` (xdist's default `--dist load`): its loadscope scheduling by work_unit, in the
    order of pytest_collection_modifyitems; another --dist is xdist's own. (Not `--dist
    loadgroup`: with pytest 9 its groups are lost, xdist 3.8 writes them to a nodeid pytest no
    longer reads, and every test became a unit of its own, its module fixtures made in both
    processes.)"""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the order above, not the most tests first
    return FileScheduling(config, log)


# A test over 3 s here (setup and call) is marked slow; `make test-fast` (`-m "not slow"`) names
# each unmarked one it ran over this many seconds (3 s and the noise of a loaded machine), so
# that the tier stays fast as tests change.
FAST_TEST_SECONDS = 5.0
_seconds = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    slow = sorted(((seconds, nodeid) for nodeid, seconds in _seconds.items()
                   if seconds > FAST_TEST_SECONDS), reverse=True)
    if slow:
        terminalreporter.section(f"unmarked tests over {FAST_TEST_SECONDS:.0f} s: mark them slow")
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


def perturb(model, seed=1):
    """Move every weight off its initial value (biases start at 0, LayerNorms at 1), so that a
    test comparing against a reference sees each parameter used."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


@pytest.fixture
def tiny_model():
    """tiny_model(pos_encoding, **overrides): a dropout-free tiny model, seeded, perturbed."""

    def build(pos_encoding, **overrides):
        torch.manual_seed(0)
        overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides}
        return perturb(tupe_ds.build_model("tiny", pos_encoding=pos_encoding, **overrides))

    return build


@pytest.fixture(scope="session")
def topic_data(tmp_path_factory) -> str:
    """tests/support/topic_corpus.py's corpus through tupe-prep, a quarter of its documents held
    out."""
    from data_prep.pipeline import PrepConfig, prepare
    from topic_corpus import DOCUMENTS, topic_documents

    folder = tmp_path_factory.mktemp("topics")
    text = folder / "topics.txt"
    text.write_text("\n\n".join(topic_documents(DOCUMENTS)) + "\n")  # a blank line ends a document
    manifest = prepare(PrepConfig(inputs=[str(text)], output=str(folder / "data"), vocab_size=512,
                                  workers=1, valid_fraction=0.25, quiet=True))
    assert manifest["documents_out"] == DOCUMENTS  # none dropped as a duplicate or as noise
    return str(folder / "data")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """One novel of the bundled corpus through tupe-prep (vocabulary 1000): a data folder."""
    from data_prep.pipeline import PrepConfig, prepare

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("prep")
    prepare(PrepConfig(inputs=[os.path.join(root, "data", "sample", "persuasion.txt.gz")],
                       output=str(out), vocab_size=1000, workers=1, valid_fraction=0.05,
                       quiet=True))
    return str(out)
