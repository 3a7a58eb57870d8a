"""Chaos: one tiny fp32 training run driven to its end through a seeded random schedule of
faults, then compared with the same run left alone.

The run is tupe-pretrain under torchrun (2 CPU ranks, ZeRO-2), through
tests/support/fault_worker.py, which injects the faults a process can suffer. Each attempt starts
the same command (a resume, after the first); what goes wrong in it, and to the run folder
between attempts, is drawn from the seed:

- in an attempt (tests/support/fault_worker.py): SIGKILL of every rank and the launcher mid-step,
  after a checkpoint file (mid-save), between the manifest and `latest`, after `latest`, during
  retention's deletion (drawn where retention has a checkpoint to delete); SIGUSR1 to one rank
  (preemption: save and stop); a full disk (every checkpoint file of one save fails with
  ENOSPC); reads of checkpoint files failing with EIO for less than the retry window
  (TUPE_DS_READ_RETRY_SECONDS) or for the whole attempt; another job taking the run folder over
  while the run trains (its record put in run.lock, as a taker does; removed after the attempt,
  that job being gone); a second job started on the same folder while the first trains; the
  next attempt on another data-parallel size or micro-batch split;
- between attempts, in the newest complete checkpoint (when an older one is there to fall back
  to) or the run folder: a file truncated, a byte flipped, a file deleted, a file added that the
  manifest does not list, a pickle that would run code (listed with a rewritten manifest,
  unlisted, or under another file's name), a damaged manifest.json, layout.json, `latest`,
  run.json or run.lock, a lock left by a process that died;
- in every attempt and in the uninterrupted run alike: NaN in rank 0's loss at NAN_STEP (a step
  the run must skip, on every rank, each time it trains it).

Every fault must fire (the worker prints "fault fired: ..." as it injects one) and be reported
by a line only its reaction prints, in the attempt where the reaction shows (a kill: the next
attempt's take-over of the killed process's run.lock, or the setting aside of the step folder
it cut short). At the end: the weights, the optimizer state and the logged losses equal the
uninterrupted run's, and so do the random generators of every rank (rng_rankR.pt), bit for bit
when every attempt had the same split; train_log.jsonl holds each step once; no complete
checkpoint was lost (one that vanished from checkpoints/ and set-aside/ in an attempt left
--keep-checkpoints newer complete ones among the live step folders: retention removed it); no
pickle's code ever ran.

Dropout (hidden and attention) is DROPOUT where the split never changes. Where it may, dropout
is 0 and the end is compared within a tolerance, random state aside: a resume on another layout
derives each rank's generators anew from (seed, step, rank) (tupe_ds/train/checkpoint/loading.py),
so with dropout the run would draw other masks than the uninterrupted one from then on.

    python bench/chaos.py --attempts 120 --seeds 1 --out build/chaos   # a few hundred faults
    (tests/test_chaos.py runs two short schedules of it)

This module is the command line. The harness that runs a schedule is bench/chaos_harness.py
(Chaos), its faults bench/chaos_faults.py, the checks and the report bench/chaos_report.py and
bench/chaos_table.py.
"""

import tupe_ds.tools.third_party_warnings  # noqa: F401  (first: filters import warnings)
import argparse
import glob
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import chaos_table  # noqa: E402
from bench.chaos_faults import FILE_FAULTS, PROCESS_FAULTS  # noqa: E402
from bench.chaos_harness import DROPOUT, ROOT, Chaos  # noqa: E402
from bench.chaos_report import compare_runs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=120, help="attempts with faults, per seed")
    p.add_argument("--seeds", default="1", help="comma-separated seeds, one schedule each")
    p.add_argument("--steps", type=int, help="the run's steps (default: 2 per attempt)")
    p.add_argument("--same-split", action="store_true",
                   help=f"never change the split: dropout {DROPOUT}, and the end (random state "
                        "included) must equal the reference bit for bit")
    p.add_argument("--kinds", help="comma-separated kinds of faults to draw (default: all): "
                                   + ", ".join(PROCESS_FAULTS + FILE_FAULTS))
    p.add_argument("--out", default=os.path.join(ROOT, "build", "chaos"))
    p.add_argument("--data", help="a tupe-prep folder (default: one novel of data/sample, "
                                  "prepared into OUT/prep)")
    p.add_argument("--tolerance", type=float, default=1e-6,
                   help="where the split changed: the largest difference allowed (absolute for "
                        "the state, relative for losses)")
    p.add_argument("--control", action="store_true",
                   help="also run the uninterrupted run on 1 process in micro-batches of 4 and "
                        "report how far it ends from the one on 2 (what a change of split alone "
                        "does, in fp32)")
    p.add_argument("--script", choices=["fresh-start", "resume-from"],
                   help="a consent the job's script keeps once given, repeated by every requeue: "
                        "--fresh-start in every attempt, or --resume-from stepK in every attempt "
                        "after one found two complete checkpoints, K the oldest (a go-back); "
                        "checked to apply once at most")
    p.add_argument("--json", help="write the reports here")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    if set(kinds or ()) - set(PROCESS_FAULTS + FILE_FAULTS):
        p.error(f"--kinds: no such kind: {set(kinds) - set(PROCESS_FAULTS + FILE_FAULTS)}")
    data = args.data or prepared_sample(args.out)
    reports = []
    for seed in map(int, args.seeds.split(",")):
        root = os.path.join(args.out, f"seed{seed}")
        shutil.rmtree(os.path.join(root, "run"), ignore_errors=True)
        for log in glob.glob(os.path.join(root, "attempt*.log")):
            os.remove(log)
        os.makedirs(root, exist_ok=True)
        chaos = Chaos(data, root, seed, steps=args.steps or 2 * args.attempts,
                      split_changes=not args.same_split, tolerance=args.tolerance,
                      kinds=kinds, script=args.script or "")
        reference = chaos.reference()
        chaos.run(args.attempts)
        summary = chaos.check(reference).summary()
        if args.control:
            control, measured = chaos.reference(os.path.join(root, "control"), (1, 4)), {}
            compare_runs(control, reference, chaos.steps, math.inf, measured, weights_only=True)
            summary["control_differences"] = measured
        reports.append(summary)
        print(json.dumps(summary, indent=1), flush=True)
    print(chaos_table.markdown(chaos_table.added(r["by_kind"] for r in reports)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 1 if any(r["problems"] for r in reports) else 0


def prepared_sample(out: str) -> str:
    from data_prep.pipeline import PrepConfig, prepare

    folder = os.path.join(out, "prep")
    if not os.path.exists(os.path.join(folder, "train.idx")):
        prepare(PrepConfig(inputs=[os.path.join(ROOT, "data", "sample", "persuasion.txt.gz")],
                           output=folder, vocab_size=1000, workers=1, valid_fraction=0.05,
                           quiet=True))
    return folder


if __name__ == "__main__":
    sys.exit(main())
