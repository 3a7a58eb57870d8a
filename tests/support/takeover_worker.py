"""tests/support/exit_worker.py with another job taking the run folder over, as after this run
was presumed gone (its node frozen beyond the lease): that job's record replaces OUT/run.lock

    TUPE_DS_TAKE_OVER="step:3"   on rank 0, in the middle of training step 3
    TUPE_DS_TAKE_OVER="save:4"   on rank 0, in the save of step 4, once every rank's files are
        written and before the manifest
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import json
import os
import sys

import exit_worker
from tupe_ds.train.checkpoint import save
from tupe_ds.train.steps import EngineSteps

OTHER_JOB = {"token": "another job", "host": "node-elsewhere", "pid": 4242,
             "started": "2026-11-26T00:00:00+00:00"}


def take_over() -> None:
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, "run.lock"), "w") as f:
        f.write(json.dumps(OTHER_JOB))


def install(when: str, step: int) -> None:
    if when == "step":
        forward = EngineSteps._forward

        def forward_then_take_over(self, *args, **kwargs):
            if self.engine.training and self.engine.global_steps + 1 == step:
                take_over()
            return forward(self, *args, **kwargs)

        EngineSteps._forward = forward_then_take_over
    else:
        wait_until_visible = save.wait_until_visible  # rank 0's first step of the commit

        def visible_then_taken_over(folder, names):
            wait_until_visible(folder, names)
            if os.path.basename(folder) == f"step{step}":
                take_over()

        save.wait_until_visible = visible_then_taken_over


if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        when, step = os.environ["TUPE_DS_TAKE_OVER"].split(":")
        install(when, int(step))
    sys.exit(exit_worker.main())
