"""The blend's schedule: which source each global sample comes from, and which of its samples.

Global sample g of the blend is sample k of source i's own stream (blend.py); i and k are
computed from g alone. The weights are whole numbers W_i of samples per PERIOD (2^31, largest
remainders: every share kept to 5e-10; a positive weight below one sample per PERIOD is
refused), and a binary tree of splits deals them out: a node passes the j-th sample that
reaches it to its left branch when floor(j x left / node + 1/2) grows (the evenest two-way
sequence: each branch within half a sample of its share), k being the count the source had
before. So the blend is a function of g like the single stream (the same samples for any
layout, resumable at any step, each source running through its epochs at its own pace),
nothing built or kept grows with the weights, the corpus or the run, and a weight of 0 never
draws.

A source's count among the first g samples is within `Schedule.within` of g x W_i / PERIOD, at
every g: half a sample per split on its path, each passed down in proportion (`spreads`). That
is below 1 for up to four sources (two pairs under the root: 1/2 + 1/2 x a fraction below 1);
the tree is the arrangement that keeps the largest least (`arrange`), which for more sources
can pass 1 a little (1.16 at most in trials of up to 24 sources over 8 decades of weights). Over
any window, a source's count is then within 2 x within of window x share (tested). Megatron's
rule (`build_blending_indices`: the next sample from the source furthest below its share), which
the blend ran over a 10,000-sample period before, errs by as much as 1.9 samples on such
weights (1.67 for a web corpus and five small ones), and is sequential: Megatron builds its
index over every sample of training.
"""

from fractions import Fraction
from typing import List, Sequence, Tuple

import numpy as np

PERIOD = 2 ** 31  # the shares' resolution; products of two counts per period fit in int64
# What a run's identity records of how the schedule is made: another rule draws other samples
SCHEDULE = "two-way splits of 2^31 samples (tupe_ds 2026-11-26)"
EXACT = 8  # branches whose every arrangement the tree search weighs (3^8 / 2 splits a try)


def whole_shares(weights: Sequence[float]) -> np.ndarray:
    """The weights as whole numbers of samples per PERIOD, summing to PERIOD: each share's floor,
    then one more for the largest remainders (the first source first among equal ones). A
    positive weight of at least 1 / PERIOD of the total (parse_sources checks) gets at least 1."""
    exact = np.asarray(weights, dtype=np.float64) / np.sum(weights) * PERIOD
    whole = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - whole), kind="stable")
    whole[order[:PERIOD - whole.sum()]] += 1
    return whole


class Schedule:
    """Which source each global sample comes from, and which of that source's samples it is."""

    def __init__(self, weights: Sequence[float]):
        self.per_period = whole_shares(weights)
        tree = split_tree([int(i) for i in np.flatnonzero(self.per_period)], self.per_period)
        nodes = []  # (samples per period, its left branch's, left branch, right branch)

        def place(branch) -> int:
            """The branch's row in nodes, or -1 - source for a source."""
            if isinstance(branch, int):
                return -1 - branch
            left, right = place(branch[0]), place(branch[1])
            nodes.append((size_of(branch, self.per_period), size_of(branch[0], self.per_period),
                          left, right))
            return len(nodes) - 1

        self.root = place(tree)
        self.size, self.left, self.left_branch, self.right_branch = np.array(
            nodes, dtype=np.int64).reshape(-1, 4).T
        self.within = np.zeros(len(self.per_period))
        for source, (spread, _) in spreads(tree, self.per_period).items():
            self.within[source] = spread / 2

    def locate(self, global_samples: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(source, the source's own global sample) of each global sample of the blend."""
        own = np.array(global_samples, dtype=np.int64).reshape(-1)
        branch = np.full(own.shape, self.root, dtype=np.int64)
        while True:
            at = np.flatnonzero(branch >= 0)
            if not at.size:
                return -1 - branch, own
            node, j = branch[at], own[at]
            size, left = self.size[node], self.left[node]
            periods, rest = np.divmod(j, size)
            # the left branch's samples among the node's first j, and first j + 1
            before = periods * left + (rest * left + size // 2) // size
            after = periods * left + ((rest + 1) * left + size // 2) // size
            goes_left = after > before
            branch[at] = np.where(goes_left, self.left_branch[node], self.right_branch[node])
            own[at] = np.where(goes_left, before, j - before)

    def counts(self, first: int, count: int) -> np.ndarray:
        """How many of the global samples [first, first + count) each source gives."""
        source, _ = self.locate(np.arange(first, first + count))
        return np.bincount(source, minlength=len(self.per_period))


def leaves(branch) -> list:
    return [branch] if isinstance(branch, int) else leaves(branch[0]) + leaves(branch[1])


def size_of(branch, sizes: np.ndarray) -> int:
    return int(sum(sizes[leaves(branch)]))


def spreads(branch, sizes: np.ndarray) -> dict:
    """{source: (c, d)} of each source under the branch: a node's spread is 1 + its fraction of
    its parent x the parent's spread (the root's is 0), so given the branch a spread S, the
    source's is c + d x S. A node's count errs from its share by at most half its spread: its
    split adds up to half a sample, and passes on the parent's error times its fraction."""
    if isinstance(branch, int):
        return {branch: (Fraction(0), Fraction(1))}
    found = {}
    for child in branch:
        fraction = Fraction(size_of(child, sizes), size_of(branch, sizes))
        for source, (c, d) in spreads(child, sizes).items():
            found[source] = (c + d, d * fraction)
    return found


def split_tree(sources: List[int], sizes: np.ndarray):
    """The tree of two-way splits over `sources` (a branch: a source, or a pair of branches)
    whose largest spread is the least found. Beyond EXACT sources the two branches closest in
    size are first paired into one (in trials of 9 to 24 sources, a largest `within` of 1.16,
    where Huffman's pairing of the two smallest gave 1.36)."""
    branches = sorted(sources, key=lambda source: -sizes[source])
    while len(branches) > EXACT:
        alike = max(range(len(branches) - 1), key=lambda i: size_of(branches[i + 1], sizes)
                    / size_of(branches[i], sizes))
        branches.append((branches.pop(alike), branches.pop(alike)))
        branches.sort(key=lambda branch: -size_of(branch, sizes))
    return arrange(branches, sizes)


def arrange(branches: list, sizes: np.ndarray):
    """The tree over `branches` whose largest spread is least, to 40 halvings of a bound t. For a
    t: the largest spread each set of branches can be given with every source in it below t,
    from its best split in two among all of them (smaller sets first); the root gives its two
    branches 1, so t is met where both can be given more."""
    if len(branches) == 1:
        return branches[0]
    every = (1 << len(branches)) - 1
    size = [0] * (every + 1)
    for mask in range(1, every + 1):
        lowest = mask & -mask
        size[mask] = size[mask ^ lowest] + size_of(branches[lowest.bit_length() - 1], sizes)
    by_count = sorted(range(1, every + 1), key=lambda mask: bin(mask).count("1"))

    def splits(mask):
        """Each split of a set in two, once (the part with its lowest branch first)."""
        lowest = mask & -mask
        rest = part = mask ^ lowest
        while True:
            if part != rest:
                yield part | lowest, rest ^ part
            if not part:
                return
            part = (part - 1) & rest

    def best(bound: float):
        """The tree keeping every source's spread below `bound`, or None."""
        largest, split = {}, {}
        for mask in by_count:
            if not mask & (mask - 1):
                found = spreads(branches[mask.bit_length() - 1], sizes).values()
                largest[mask] = min(float((bound - c) / d) for c, d in found)
            else:
                largest[mask], split[mask] = max(
                    (min((largest[a] - 1) * size[mask] / size[a],
                         (largest[b] - 1) * size[mask] / size[b]), (a, b))
                    for a, b in splits(mask))
        top, halves = max((min(largest[a], largest[b]), (a, b)) for a, b in splits(every))

        def build(mask):
            if not mask & (mask - 1):
                return branches[mask.bit_length() - 1]
            return build(split[mask][0]), build(split[mask][1])

        return (build(halves[0]), build(halves[1])) if top > 1 else None

    low, high = 1.0, float(sum(len(leaves(branch)) for branch in branches))  # above any depth
    tree = best(high)
    for _ in range(40):
        middle = (low + high) / 2
        found = best(middle)
        low, high, tree = (middle, high, tree) if found is None else (low, middle, found)
    return tree
