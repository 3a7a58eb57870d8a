import glob
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import tupe_ds  # noqa: E402


DEEPSPEED_SHARED_MEMORY = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(scope="session")
def shared_memory_before_the_tests():
    return set(glob.glob(DEEPSPEED_SHARED_MEMORY))


def mapped_files() -> set:
    """Every file some process on this machine has mapped (from /proc/PID/maps)."""
    paths = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                paths.update(line.split(maxsplit=5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return paths


@pytest.fixture(autouse=True)
def remove_deepspeed_shared_memory(shared_memory_before_the_tests):
    """DeepSpeed's CPU all-reduce leaves a 66 MB buffer per rank in /dev/shm (memory) when a run
    ends; after each test, remove those the suite's runs left, so that the suite does not fill the
    memory. A buffer some process still maps (another run on this machine) stays."""
    yield
    left = set(glob.glob(DEEPSPEED_SHARED_MEMORY)) - shared_memory_before_the_tests
    for path in left - mapped_files() if left else ():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


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
