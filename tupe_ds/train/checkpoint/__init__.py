"""A run's checkpoints and its history: saved (save.py), chosen and verified at a start
(resume.py, from history.py's decision), checked to be the same run (same_run.py), loaded
(loading.py) or started from (init_from.py), reshaped (reshard.py). The rules: docs/reliability.md."""

from tupe_ds.train.checkpoint.folder import latest_step
from tupe_ds.train.checkpoint.init_from import InitPlan
from tupe_ds.train.checkpoint.resume import ResumePlan

__all__ = ["latest_step", "InitPlan", "ResumePlan"]
