"""Training: run config, checkpoints, monitoring (the loop itself is tupe_ds/pretrain.py)."""
