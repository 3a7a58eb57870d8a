"""Random numbers that are a function of their coordinates: (seed, epoch, sample, stream,
position) -> 64 random bits, computed for a whole micro-batch in a few numpy operations.

A generator object per sample (numpy's Generator or Philox) costs tens of microseconds to
create, more than masking the sample; a counter-based generator has no state to create, so each
sample's masking depends on its coordinates only, however the samples are batched. No library
offers one vectorised over keys in numpy, so it is written here: SplitMix64's finalizer (Steele,
Lea and Flood, 2014) as the mixing function, and a four-round Feistel network keyed by it as the
per-epoch order of the samples (a random permutation of [0, count) in O(1) memory, evaluated at
any position).
"""

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))

# The streams of one sample: which positions are chosen, what becomes of them, the random ids,
# ELECTRA's generator's draws at them; and the stream of an epoch's order.
CHOICE, ACTION, REPLACEMENT, ORDER, GENERATOR = 0, 1, 2, 3, 4


def mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 whose output bits all depend on every input
    bit (wrapping multiplication is what numpy's uint64 arrays do)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> _SHIFTS[0])) * _MULTIPLIERS[0]
    x = (x ^ (x >> _SHIFTS[1])) * _MULTIPLIERS[1]
    return x ^ (x >> _SHIFTS[2])


def absorb(key: np.ndarray, value) -> np.ndarray:
    """A key for (key, value): `value` broadcasts against `key`."""
    return mix(np.asarray(key, dtype=np.uint64) * _GOLDEN + np.asarray(value).astype(np.uint64))


@np.errstate(over="ignore")  # a scalar's wrapping warns where an array's does not
def sample_keys(seed: int, epoch, samples, stream: int) -> np.ndarray:
    """One key per sample of `samples` (epoch broadcasts against it) for one stream; at least
    one-dimensional."""
    base = absorb(np.uint64(seed % 2**64), np.asarray(epoch, dtype=np.int64))
    return np.atleast_1d(absorb(absorb(base, np.asarray(samples, dtype=np.int64)), stream))


def bits(keys: np.ndarray, positions) -> np.ndarray:
    """64 random bits at each (key, position) pair (broadcast)."""
    return absorb(keys, positions)


def uniform(keys: np.ndarray, positions) -> np.ndarray:
    """Floats in [0, 1) with 53 random bits each, at each (key, position) pair (broadcast)."""
    return (bits(keys, positions) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def permutation(seed: int, epoch: int, count: int, positions: np.ndarray) -> np.ndarray:
    """The sample at each of `positions` in epoch `epoch`'s order of `count` samples: a Feistel
    network (alternating, so its halves may differ by a bit) permutes [0, 2**bits) for the
    smallest 2**bits >= count, and values past `count` are sent through it again until they fall
    inside ("cycle walking": fewer than two passes on average), which keeps it a bijection of
    [0, count)."""
    width = max(2, (count - 1).bit_length())
    high_bits, low_bits = width // 2, width - width // 2
    high_mask, low_mask = np.uint64((1 << high_bits) - 1), np.uint64((1 << low_bits) - 1)
    keys = [absorb(sample_keys(seed, epoch, 0, ORDER), round_) for round_ in range(4)]
    values = np.asarray(positions, dtype=np.uint64).copy()
    walking = np.ones(values.shape, dtype=bool)
    while walking.any():
        high, low = values[walking] >> np.uint64(low_bits), values[walking] & low_mask
        for round_, key in enumerate(keys):
            if round_ % 2:
                low = low ^ (absorb(key, high) & low_mask)
            else:
                high = high ^ (absorb(key, low) & high_mask)
        values[walking] = (high << np.uint64(low_bits)) | low
        walking = values >= np.uint64(count)
    return values.astype(np.int64)
