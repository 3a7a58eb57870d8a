"""Comparing positional encodings: plan, runs, report (tupe-compare)."""
