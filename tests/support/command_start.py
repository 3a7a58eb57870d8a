"""Imported first by the workers the tests launch: their processes start as a tupe_ds command's
do (tupe_ds/tools/startup.py: the collector paused while the libraries import; main() resumes
it)."""

from tupe_ds.tools import startup

startup.pause_collector()
