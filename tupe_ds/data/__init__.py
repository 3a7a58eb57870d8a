"""Indexed data -> sample index (built once, memory-mapped) -> packed FULL-SENTENCES samples ->
dynamic masking -> batches per rank, made ahead of the step."""
