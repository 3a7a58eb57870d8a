"""Training: run config, the loop (loop.py; tupe_ds/pretrain.py is its command), steps,
checkpoints, monitoring."""
