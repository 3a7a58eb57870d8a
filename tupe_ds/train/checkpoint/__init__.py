"""A run's checkpoints and its history: saved (save.py), chosen and verified at a start
(resume.py, from history.py's decision), checked to be the same run (same_run.py), loaded
(loading.py) or started from (init_from.py), reshaped (reshard.py).
The rules: docs/reliability.md."""
