"""Corpus preparation: raw text -> megatron-core indexed datasets (see data_prep/cli.py)."""
