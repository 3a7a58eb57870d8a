"""The chaos test (bench/chaos.py, CI-sized): one tiny fp32 training run driven to its end
through a seeded schedule holding every kind of fault (SIGKILL mid-step, mid-save, between the
manifest and `latest`, during retention; SIGUSR1; a second job on the folder; another job
taking the folder over; a full disk; reads failing with EIO for a moment or for a whole attempt;
another dp or micro-batch split; truncated, flipped, missing, unlisted and code-running files;
damaged manifest, layout, `latest`, run.json and lock; a lock of a dead process; a NaN loss on
one rank), then compared with the uninterrupted run: weights, optimizer state and logged losses
equal (bit for bit, random state included, with dropout on, when the split never changed; else
within 1e-6 without dropout), each step logged once, every fault fired and reported by the line
only its reaction prints, nothing complete lost, no planted code run. bench/chaos.py runs
hundreds of faults (bench/README.md, "chaos.py")."""

import pytest

from bench.chaos_faults import FILE_FAULTS, PROCESS_FAULTS
from bench.chaos_harness import Chaos

STEPS = 26


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """The uninterrupted runs, by whether the split may change (which sets the dropout)."""
    root = str(tmp_path_factory.mktemp("chaos-reference"))
    return {split_changes: Chaos(data, root, seed=0, steps=STEPS,
                                 split_changes=split_changes).reference()
            for split_changes in (True, False)}


@pytest.mark.parametrize("seed, split_changes, attempts", [(11, True, 16), (12, False, 4)])
@pytest.mark.slow
def test_a_run_through_random_faults_ends_as_the_uninterrupted_one(data, references, tmp_path,
                                                                   seed, split_changes,
                                                                   attempts):
    chaos = Chaos(data, str(tmp_path), seed, steps=STEPS, split_changes=split_changes,
                  cover=True)
    chaos.run(attempts)
    report = chaos.check(references[split_changes])
    assert report.problems == [], "\n".join(report.problems)
    triggered = {fault.kind for fault in report.faults if fault.triggered}
    if split_changes:  # the long schedule holds every kind of fault
        assert set(FILE_FAULTS + PROCESS_FAULTS) <= triggered, \
            set(FILE_FAULTS + PROCESS_FAULTS) - triggered
        assert report.split_changed
    else:
        assert report.identical  # bit for bit, random state included
    assert all(fault.reported for fault in report.faults if fault.expect)
