"""Dynamic masking: which tokens a sample's loss is on, and what the model sees there."""

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100  # the label of a token the loss skips (torch's cross-entropy default)


@dataclass(frozen=True)
class MaskingScheme:
    """Of the `probability` share of tokens chosen, `mask` become [MASK], `random` a random
    token, the rest stay. BERT: 15% with 80/10/10; ELECTRA's generator: 15% with 85/0/15."""

    probability: float = 0.15
    mask: float = 0.8
    random: float = 0.1


BERT_MASKING = MaskingScheme()
ELECTRA_MASKING = MaskingScheme(probability=0.15, mask=0.85, random=0.0)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, scheme: MaskingScheme,
                mask_id: int, random_low: int, random_high: int, special: np.ndarray):
    """(inputs, labels): labels hold the original ids at chosen positions, IGNORE_INDEX elsewhere.

    Exactly round(probability * candidates) positions (at least 1) are chosen among the tokens
    not in `special`; random replacements are drawn from [random_low, random_high).
    """
    candidates = np.flatnonzero(~np.isin(tokens, special))
    count = min(len(candidates), max(1, int(round(scheme.probability * len(candidates)))))
    chosen = rng.choice(candidates, size=count, replace=False)
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[chosen] = tokens[chosen]
    inputs = tokens.copy()
    action = rng.random(count)
    to_mask = chosen[action < scheme.mask]
    to_random = chosen[(action >= scheme.mask) & (action < scheme.mask + scheme.random)]
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.integers(random_low, random_high, size=len(to_random))
    return inputs, labels
