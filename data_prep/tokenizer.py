"""Stage 4, byte-pair encoding with HF tokenizers: train one, or load one given."""

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.clean import EMAIL_TOKEN, URL_TOKEN

# [PAD] must be id 0; the order fixes the ids of all special tokens.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", URL_TOKEN, EMAIL_TOKEN]


def train_tokenizer(sentences: Iterable[str], vocab_size: int, min_frequency: int,
                    show_progress: bool = True) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so decoding gives the text back exactly."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(sentences, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"{path}: not a tokenizers JSON file ({error})") from None
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"{path}: tokenizer lacks the special tokens {', '.join(missing)}")
    if tokenizer.token_to_id("[PAD]") != 0:
        raise ValueError(f"{path}: [PAD] must have id 0, has {tokenizer.token_to_id('[PAD]')}")
    return tokenizer
