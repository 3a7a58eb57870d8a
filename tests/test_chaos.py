"""The chaos test (bench/chaos.py, CI-sized): one tiny fp32 training run driven to its end
through a seeded schedule holding every kind of fault (SIGKILL mid-step, mid-save, between the
manifest and `latest`, during retention; SIGUSR1; a second job on the folder; another job
taking the folder over; a full disk; reads failing with EIO for a moment or for a whole attempt;
another dp or micro-batch split; truncated, flipped, missing, unlisted and code-running files;
damaged manifest, layout, `latest`, run.json and lock; a lock of a dead process; a NaN loss on
one rank), then compared with the uninterrupted run: weights, optimizer state and logged losses
equal (bit for bit, random state included, with dropout on, when the split never changed; else
within 1e-6 without dropout), each step logged once, every fault fired and reported by the line
only its reaction prints, nothing complete lost, no planted code run. The schedule that keeps
the split is a job script that keeps a `--resume-from` once given, as a requeue repeats it: on
2 ranks the consent goes back to the oldest of two checkpoints, giving up the newer, once,
and never again. bench/chaos.py runs hundreds of faults (bench/README.md, "chaos.py")."""

import pytest

from bench.chaos_faults import FILE_FAULTS, PROCESS_FAULTS
from bench.chaos_harness import Chaos
from tupe_ds.train.checkpoint import history

STEPS = 26


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """The uninterrupted runs, by whether the split may change (which sets the dropout)."""
    root = str(tmp_path_factory.mktemp("chaos-reference"))
    return {split_changes: Chaos(data, root, seed=0, steps=STEPS,
                                 split_changes=split_changes).reference()
            for split_changes in (True, False)}


@pytest.mark.parametrize("seed, split_changes, attempts, script",
                         [(11, True, 16, ""), (12, False, 4, "resume-from")])
@pytest.mark.slow
def test_a_run_through_random_faults_ends_as_the_uninterrupted_one(data, references, tmp_path,
                                                                   seed, split_changes,
                                                                   attempts, script):
    chaos = Chaos(data, str(tmp_path), seed, steps=STEPS, split_changes=split_changes,
                  cover=True, script=script)
    chaos.run(attempts)
    report = chaos.check(references[split_changes])
    assert report.problems == [], "\n".join(report.problems)  # a consent applied twice too
    if script:  # applied once (consents_spent), on 2 ranks, giving up a newer checkpoint
        consent = next(r for r in history.read(chaos.out) if r["kind"] == "consent")
        assert consent["outcome"] == "applied" and consent["gives_up"], consent
    triggered = {fault.kind for fault in report.faults if fault.triggered}
    if split_changes:  # the long schedule holds every kind of fault
        assert set(FILE_FAULTS + PROCESS_FAULTS) <= triggered, \
            set(FILE_FAULTS + PROCESS_FAULTS) - triggered
        assert report.split_changed
    else:
        assert report.identical  # bit for bit, random state included
    assert all(fault.reported for fault in report.faults if fault.expect)
