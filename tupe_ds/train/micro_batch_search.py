"""The search of --micro-batch auto: the sizes it probes, the figures every rank agrees on, and
the texts that say why a size was chosen or what to change when none fits.

Activation memory grows linearly with the micro-batch: after two probes the line through the two
largest that fit predicts the rest, so the search goes 1, 2, then straight to the largest predicted
to fit, each choice measured. No probe of a size predicted not to fit runs: an out-of-memory inside
a pass would leave tensor-parallel partners waiting in a collective (on a GPU it still only means
"does not fit"). Every probe's figures are gathered from all ranks and each takes the tightest
rank's (the most over, or the least under, its memory), so every rank probes the same sizes in the
same order and ends with the same micro-batch, the largest that fits on all of them, which
DeepSpeed needs.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tupe_ds.train.micro_batch_probe import GIB, HEADROOM


@dataclass(frozen=True)
class Probe:
    """One micro-batch probed, as every rank sees it: the bytes the tightest rank needs (inf:
    out of memory) and may use."""
    micro_batch: int
    needed: float
    budget: float

    @property
    def over(self) -> float:
        return self.needed - self.budget

    @property
    def fits(self) -> bool:
        return self.over <= 0


def agreed(micro_batch: int, needed: float, budget: float, device: torch.device) -> Probe:
    """The probe as every rank sees it: the figures of the rank furthest over (or least under)
    its memory, gathered from all."""
    mine = torch.tensor([needed, budget], dtype=torch.float64, device=device)
    figures = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(figures, mine)
    tightest = max(figures, key=lambda pair: (pair[0] - pair[1]).item())
    return Probe(micro_batch, *tightest.tolist())


def predicted(fitting: list, micro_batch: int) -> float:
    """How far over its memory the tightest rank would be at `micro_batch` (bytes; at most 0:
    it fits), on the line through the two largest probes that fit."""
    below, above = fitting[-2], fitting[-1]
    slope = (above.over - below.over) / (above.micro_batch - below.micro_batch)
    return above.over + slope * (micro_batch - above.micro_batch)


def largest_fitting(sizes: list, probe: Callable[[int], Probe]) -> tuple:
    """(index in `sizes` (ascending) of the largest that fits, -1 for none; the probes made).
    The two smallest first, then the largest predicted to fit between the largest known to fit
    and the smallest known not to; none predicted ends the search."""
    made, fitting = [], []
    low, high = -1, len(sizes)
    while high - low > 1:
        if len(fitting) < 2:
            index = low + 1
        else:
            index = max((i for i in range(low + 1, high)
                         if predicted(fitting, sizes[i]) <= 0), default=None)
            if index is None:
                break
        made.append(probe(sizes[index]))
        if made[-1].fits:
            low = index
            fitting.append(made[-1])
        else:
            high = index
    return low, made


def size_text(size: float) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


def needs_text(probe: Probe, where: str) -> str:
    if math.isinf(probe.needed):
        return f"{probe.micro_batch} runs out of memory"
    return (f"{probe.micro_batch} needs {size_text(probe.needed)} of {size_text(probe.budget)} "
            f"{where}")


def search_text(sizes: list, chosen: int, made: list, where: str, run, seconds: float) -> str:
    """Why `sizes[chosen]`: what it needs, what the next size needs or would need."""
    share = run.batch_split.global_batch // run.batch_split.dp
    fit = next(p for p in made if p.micro_batch == sizes[chosen])
    text = (f"the largest of {', '.join(map(str, sizes))} (divisors of each rank's {share} "
            f"samples{' the batch ramp allows' if run.batch_split.ramp else ''}) that fits at seq "
            f"{run.seq_len} with {HEADROOM:.0%} headroom: {needs_text(fit, where)}")
    if chosen + 1 < len(sizes):
        after = sizes[chosen + 1]
        probed = next((p for p in made if p.micro_batch == after), None)
        fitting = [p for p in made if p.fits]
        text += (f", {needs_text(probed, where)}" if probed else
                 f", {after} would need "
                 f"{size_text(predicted(fitting, after) + fitting[-1].budget)} (on the line "
                 f"through {fitting[-2].micro_batch} and {fitting[-1].micro_batch})")
    return text + f"; {len(made)} probes in {seconds:.1f} s"


def nothing_fits(first: Probe, states: float, where: str, run) -> str:
    """What to change when not even the smallest micro-batch fits."""
    stage = run.ds_config.get("zero_optimization", {}).get("stage", 0)
    sharding = " or ".join(str(higher) for higher in (2, 3) if higher > stage)
    return (f"--micro-batch auto: not even micro-batch {first.micro_batch} fits at seq "
            f"{run.seq_len} with {HEADROOM:.0%} headroom on every rank ({needs_text(first, where)}"
            f"; the model states {size_text(states)} by DeepSpeed's estimate for ZeRO stage "
            f"{stage} over {run.dp_size} data-parallel rank(s)): "
            + (f"shard them with --zero-stage {sharding}, " if sharding else "")
            + "spread them over more GPUs, split the model with --tp, shorten --seq-len, or give "
            "--micro-batch N to train without the probe")
