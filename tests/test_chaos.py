"""The chaos test (bench/chaos.py, CI-sized): one tiny fp32 training run driven to its end
through a seeded schedule holding every kind of fault (SIGKILL mid-step, mid-save, between the
manifest and `latest`, during retention; SIGUSR1; a second job on the folder; a full disk;
another dp or micro-batch split; truncated, flipped, missing, unlisted and code-running files;
damaged manifest, layout, `latest`, run.json and lock; a lock of a dead process; a NaN loss on
one rank), then compared with the uninterrupted run: weights, optimizer state and logged losses
equal (bit for bit when the split never changed, else within 1e-6), each step logged once,
every fault reported, nothing complete lost, no planted code run. bench/chaos.py runs hundreds
of faults (bench/README.md, "chaos.py")."""

import pytest

from bench.chaos import FILE_FAULTS, PROCESS_FAULTS, Chaos

STEPS = 26


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos-reference")
    return Chaos(data, str(root), seed=0, steps=STEPS).reference(str(root / "reference"))


@pytest.mark.parametrize("seed, split_changes, attempts", [(11, True, 14), (12, False, 6)])
def test_a_run_through_random_faults_ends_as_the_uninterrupted_one(data, reference, tmp_path,
                                                                   seed, split_changes,
                                                                   attempts):
    chaos = Chaos(data, str(tmp_path), seed, steps=STEPS, split_changes=split_changes,
                  cover=True)
    chaos.run(attempts)
    report = chaos.check(reference)
    assert report.problems == [], "\n".join(report.problems)
    triggered = {fault.kind for fault in report.faults if fault.triggered}
    if split_changes:  # the long schedule holds every kind of fault
        assert set(FILE_FAULTS) <= triggered, set(FILE_FAULTS) - triggered
        assert set(PROCESS_FAULTS) - {"kill-during-deletion"} <= triggered, \
            set(PROCESS_FAULTS) - triggered
        assert report.split_changed
    else:
        assert not report.split_changed  # so the end was compared bit for bit
    assert all(fault.reported for fault in report.faults if fault.triggered and fault.expect)
