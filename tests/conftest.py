import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# the tests' helpers (runs, workers, the Slurm cluster), imported by name as the workers, which
# run as scripts from there, import each other
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import pytest  # noqa: E402
import torch  # noqa: E402

import tupe_ds  # noqa: E402

# `make test` runs the files in 2 processes (pytest-xdist, --dist loadgroup): each file whole in
# one of them, so that a file's module fixtures (a reference run, a Slurm cluster) are made once;
# the files that start Slurm clusters in one, one after the other.
ONE_AT_A_TIME = {"test_slurm.py": "slurm", "test_multinode.py": "slurm"}
# The longest first (seconds in one process, `pytest --durations`, 2026-11-26), so that neither
# process is left alone with a long one at the end; the others after them, as collected.
LONGEST = {"slurm": 297, "test_run_integrity.py": 316, "test_chaos.py": 162,
           "test_compare.py": 139, "test_loss_normalization.py": 106,
           "test_resume_layout.py": 101, "test_pipeline.py": 97}


def pytest_collection_modifyitems(items):
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group(ONE_AT_A_TIME.get(name, name)))
    items.sort(key=lambda item: -LONGEST.get(ONE_AT_A_TIME.get(item.path.name, item.path.name), 0))


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
def data(tmp_path_factory):
    """One novel of the bundled corpus through tupe-prep (vocabulary 1000): a data folder."""
    from data_prep.pipeline import PrepConfig, prepare

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("prep")
    prepare(PrepConfig(inputs=[os.path.join(root, "data", "sample", "persuasion.txt.gz")],
                       output=str(out), vocab_size=1000, workers=1, valid_fraction=0.05, quiet=True))
    return str(out)
