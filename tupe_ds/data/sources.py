"""The --data sources: each prepared folder with its weight and its name, parsed and checked.

`--data FOLDER`, or a blend's weights and folders (`--data 0.7 wiki 0.3 books`), each folder
given as itself or as NAME=FOLDER; the name is what the source's metrics carry.
"""

import os
import re
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from tupe_ds.data.blend_schedule import PERIOD

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # its metrics: train/share/NAME, valid/NAME/loss
GENERIC_FOLDERS = ("merged",)  # slurm/submit_prep.sh's prep/NAME/merged: the parent names it
NAMING = "letters, digits, '.', '_' and '-', from a letter or digit"


@dataclass(frozen=True)
class Source:
    """A prepared folder of the blend, its weight (as given), the name its metrics carry and
    the folder of its sample indexes."""

    folder: str
    weight: float
    name: str
    index_cache: str = ""


def named_folder(value: str) -> Tuple[str, str]:
    """(name, folder) of a --data folder: `wiki=prep/wiki` names it; else the folder's own name,
    or its parent's where its own is generic (prep/wiki/merged: wiki). An '=' after a '/' is
    part of the folder."""
    name, equals, folder = value.partition("=")
    if equals and os.sep not in name:
        if not folder:
            raise ValueError(f"--data {value}: no folder after the name; write NAME=FOLDER")
        return name, folder
    path = os.path.abspath(value)
    own = os.path.basename(path)
    return (os.path.basename(os.path.dirname(path)) if own in GENERIC_FOLDERS else own), value


def parse_sources(values: Sequence[str]) -> List[Source]:
    """`--data FOLDER` or `--data W1 FOLDER1 W2 FOLDER2 ...` (Megatron's --data-path form; the
    weights need not sum to 1: token counts like 3.2e9 do), each FOLDER or NAME=FOLDER. Raises
    ValueError naming what is wrong."""
    values = list(values)
    if len(values) == 1:  # its name is its metrics' only where it is given
        name, folder = named_folder(values[0])
        if folder != values[0]:
            check_names([Source(folder, 1.0, name)], values)
        return [Source(folder, 1.0, name)]
    if len(values) % 2:
        raise ValueError(f"--data {' '.join(values)}: one folder, or pairs of a weight and a "
                         "folder (--data 0.7 wiki 0.3 books)")
    sources = []
    for weight, value in zip(values[::2], values[1::2]):
        try:
            number = float(weight)
        except ValueError:
            raise ValueError(f"--data: {weight!r} before {value} is not a weight; write "
                             "pairs of a weight and a folder (--data 0.7 wiki 0.3 books)") from None
        if not np.isfinite(number) or number < 0:
            raise ValueError(f"--data: the weight of {value} is {weight}; weights are numbers "
                             "of 0 or more")
        name, folder = named_folder(value)
        sources.append(Source(folder, number, name))
    total = sum(source.weight for source in sources)
    if total <= 0:
        raise ValueError("--data: every weight is 0; give a source a positive weight")
    if not np.isfinite(total):
        raise ValueError("--data: the weights add up to more than a float holds; scale them "
                         "down alike")
    weights = np.array([source.weight for source in sources])
    for source, exact in zip(sources, weights / np.sum(weights) * PERIOD):  # as whole_shares
        if 0 < source.weight and exact < 1:
            raise ValueError(f"--data: the weight of {source.folder}, {source.weight:g}, is "
                             f"{exact / PERIOD:.2g} of the total, below the blend's resolution "
                             "(a sample in 2^31): give it more, or 0 to leave the source out")
    folders = [os.path.normpath(source.folder) for source in sources]
    if len(set(folders)) < len(folders):
        raise ValueError(f"--data: a folder is named twice ({' '.join(folders)}); give each "
                         "source once, with its whole weight")
    check_names(sources, values[1::2])
    return sources


def check_names(sources: Sequence[Source], values: Sequence[str]) -> None:
    """Each source's name (from its --data value) a part of a tag, and none twice."""
    seen = {}
    for source, value in zip(sources, values):
        if not NAME.fullmatch(source.name):
            raise ValueError(f"--data {value}: {source.name!r} is not a source name ({NAMING})"
                             + ("" if value != source.folder else
                                f"; name the source: NAME={source.folder}"))
        if source.name in seen:
            raise ValueError(f"--data: {seen[source.name]} and {value} are both named "
                             f"{source.name}; name one: NAME={source.folder}")
        seen[source.name] = value


def shares(sources: Sequence[Source]) -> np.ndarray:
    weights = np.array([source.weight for source in sources], dtype=np.float64)
    return weights / weights.sum()
