"""Benchmarks: each prints the ratios it measures in one run (bench/README.md has the
figures). The CPU ones run as scripts (`python bench/NAME.py`), the GPU ones as modules of
bench.gpu (`python -m bench.gpu.suite`)."""

# python -m bench.gpu.*: filters the third-party import warnings before anything is imported
import tupe_ds.tools.third_party_warnings  # noqa: F401,E402
