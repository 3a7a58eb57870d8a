"""What tupe-finetune has already done, so that the same command again (after a kill, a Slurm
requeue, or to add learning rates or seeds) redoes nothing that is finished.

Each (learning rate, seed) result goes to OUT/TASK.progress.json as soon as it is known, under the
settings that produced it: the exported model's source checkpoint, the data files and every
hyper-parameter but the grid. A result is reused only under equal settings; TASK.json records the
settings too, and a task whose TASK.json has them and the same grid is finished.
"""

import fcntl
import json
import os
from typing import Optional

from tupe_ds.tools.errors import TaskBusy
from tupe_ds.tools.files import write_atomically


def finetune_settings(args, task, model_source: Optional[str], valid: dict) -> dict:
    """What a fine-tuning result depends on besides its learning rate and seed; `args` with its
    global batch resolved (flags.global_batch_size), kept as "batch_size" (earlier versions'
    name: their results stay valid)."""
    return {"model": os.path.abspath(args.model), "source": model_source, "task": task.name,
            "train": os.path.abspath(args.train),
            "valid": {name: os.path.abspath(path) for name, path in valid.items()},
            "epochs": args.epochs or task.epochs, "batch_size": args.global_batch_size,
            "warmup_ratio": args.warmup_ratio, "weight_decay": args.weight_decay,
            "dropout": args.dropout, "max_length": args.max_length}


def finished(out: str, task: str, settings: dict, lrs: list, seeds: list) -> bool:
    """OUT/TASK.json holds this grid's results under these settings."""
    path = os.path.join(out, f"{task}.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        summary = json.load(f)
    configurations = summary["configurations"].values()
    return (summary.get("settings") == settings
            and sorted(c["lr"] for c in configurations) == sorted(lrs)
            and all(sorted(map(int, c["seeds"])) == sorted(seeds) for c in configurations))


def hold(out: str, task: str):
    """OUT/TASK.lock, held by this process (rank 0) until it exits: the open file. TaskBusy when
    another process holds it: two fine-tunes of one task into one folder would remove each
    other's running trials' curves and lose each other's results."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{task}.lock")
    held = open(path, "a")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise TaskBusy(f"--out {out}: another tupe-finetune is fine-tuning {task} there (it holds "
                       f"{path}); wait for it to end, or give another --out") from None
    return held


class Progress:
    """The results of earlier attempts under the same settings; `record` adds one (rank 0)."""

    def __init__(self, out: str, task: str, settings: dict, writer: bool):
        self.path = os.path.join(out, f"{task}.progress.json")
        self.settings, self.writer, self.results = settings, writer, {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = json.load(f)
            if kept["settings"] == settings:
                self.results = kept["results"]

    @staticmethod
    def key(lr: float, seed: int) -> str:
        return f"lr={lr:g} seed={seed}"

    def get(self, lr: float, seed: int) -> Optional[dict]:
        return self.results.get(self.key(lr, seed))

    def record(self, lr: float, seed: int, results: dict) -> dict:
        self.results[self.key(lr, seed)] = results
        if self.writer:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomically(self.path, json.dumps({"settings": self.settings,
                                                    "results": self.results}, indent=1))
        return results
