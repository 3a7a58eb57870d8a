"""What a check of the machine found: tupe-doctor's and the Slurm check's findings."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    fatal: bool  # the run would fail; else a warning
    text: str  # what is wrong and what to change
