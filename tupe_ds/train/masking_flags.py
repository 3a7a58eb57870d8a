"""--mask-rate and --mask-split: each value checked as the parser reads it, and the objective's
masking scheme with what they change."""

import argparse
import dataclasses

from tupe_ds.data.masking import BERT_MASKING, MaskingScheme


def mask_rate(text: str) -> float:
    rate = float(text)
    if not 0 < rate < 1:
        raise argparse.ArgumentTypeError(f"{text}: the share of tokens chosen must be above 0 "
                                         f"and below 1 (BERT's is {BERT_MASKING.probability:g})")
    return rate


def mask_split(text: str) -> tuple:
    """(mask, random) from "M,R"."""
    try:
        mask, random = (float(share) for share in text.split(","))
    except ValueError:
        bert = f"{BERT_MASKING.mask:g},{BERT_MASKING.random:g}"
        raise argparse.ArgumentTypeError(f"{text}: give two shares, M,R (BERT's are {bert})") \
            from None
    if not (0 <= mask <= 1 and 0 <= random <= 1 and mask + random <= 1):
        raise argparse.ArgumentTypeError(
            f"{text}: each share must be between 0 and 1 and the two add up to at most 1 (the "
            "rest of the chosen tokens stay as they were)")
    return mask, random


def masking_scheme(args: argparse.Namespace, objective_default: MaskingScheme) -> MaskingScheme:
    """The objective's masking with what --mask-rate and --mask-split change."""
    given = {}
    if args.mask_rate is not None:
        given["probability"] = args.mask_rate
    if args.mask_split is not None:
        given["mask"], given["random"] = args.mask_split
    return dataclasses.replace(objective_default, **given)
