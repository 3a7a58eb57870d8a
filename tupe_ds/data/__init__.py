"""Indexed data -> packed FULL-SENTENCES samples -> dynamic masking -> batches per rank."""
