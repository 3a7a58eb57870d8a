"""What `make demo` shows after training: the validation loss, the accuracy at the held-out
[MASK] positions next to the unigram guess's, the true word's rank and probability in held-out
sentences by the model and by the unigram, and the TensorBoard command.

The unigram is the training split's token frequencies: what a model that ignores the context
would learn. Its guess is always the most frequent token."""

import argparse
import contextlib
import io
import os
import sys
from typing import NamedTuple

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import BERT_MASKING, IGNORE_INDEX, MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.export.read import load_exported
from tupe_ds.export.write import export
from tupe_ds.train import monitor
from tupe_ds.train.data_folders import index_cache

SENTENCES = 3  # held-out sentences filled
SENTENCE_TOKENS = (8, 40)  # the lengths of the sentences eligible
TOP = 3  # the model's guesses shown per sentence
EVAL_SAMPLES = 256
EVAL_SEED = 7  # the masks of the held-out samples: the same in every report
LEARNED = 1.5  # times the unigram's accuracy below which the report says to train on


def validations(out: str) -> list:
    """[(step, loss)] of the run's validations by step, a step validated again (after a resume)
    by its last."""
    return sorted(dict(monitor.validations(os.path.join(out, "train_log.jsonl"))).items())


def unigram_counts(data: str) -> torch.Tensor:
    """[vocabulary] how often each token occurs in the training split."""
    prefix = os.path.join(data, "train")
    tokens = np.fromfile(prefix + ".bin", dtype=IndexedDataset(prefix).index.dtype)
    return torch.from_numpy(np.bincount(tokens, minlength=Vocabulary.from_data_dir(data).size))


def held_out_batch(data: str, out: str, seq_len: int):
    """Up to EVAL_SAMPLES valid samples, masked alike in every report; their sample index from
    where the run keeps it (data_folders.index_cache)."""
    vocab = Vocabulary.from_data_dir(data)
    cache = index_cache(argparse.Namespace(index_cache=None, out=out), data)
    packed = PackedSentences(os.path.join(data, "valid"), seq_len, vocab.cls, vocab.sep, cache)
    samples = MaskedSamples(packed, vocab, BERT_MASKING, seed=EVAL_SEED)
    return samples.global_samples(0, min(EVAL_SAMPLES, len(packed)))


class MaskedWordAccuracy(NamedTuple):
    """At the [MASK] positions of held_out_batch: the share each guesser got right, and how many
    samples and masks there were."""
    model: float
    unigram: float  # always guessing unigram_token
    unigram_token: int
    samples: int
    masks: int


def masked_word_accuracy(model, data: str, out: str, seq_len: int,
                         unigram: torch.Tensor) -> MaskedWordAccuracy:
    """How often the model, and the unigram's guess, name the hidden token at the [MASK]
    positions of held_out_batch. The training's valid/accuracy counts every position chosen for
    masking, of which BERT leaves some as they were (80/10/10): copying those is not learning,
    so this counts the [MASK] ones only."""
    vocab = Vocabulary.from_data_dir(data)
    batch = held_out_batch(data, out, seq_len)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])
    masked = (batch["input_ids"] == vocab.mask) & (batch["labels"] != IGNORE_INDEX)
    answers = batch["labels"][masked]
    guessed = logits[masked][:, :vocab.size].argmax(-1)
    unigram_token = int(unigram.argmax())
    return MaskedWordAccuracy(model=(guessed == answers).float().mean().item(),
                              unigram=(answers == unigram_token).float().mean().item(),
                              unigram_token=unigram_token, samples=len(batch["input_ids"]),
                              masks=len(answers))


def shown(tokenizer: Tokenizer, token: int) -> str:
    return repr(tokenizer.decode([token]).strip())


def learning_lines(accuracy: MaskedWordAccuracy, losses: list, tokenizer: Tokenizer) -> list:
    ratio = accuracy.model / accuracy.unigram if accuracy.unigram else float("inf")
    return ["", "Validation loss (held-out text): " + ", ".join(
                f"step {step} {loss:.3f}" for step, loss in losses),
            f"Accuracy at the [MASK] positions only ({accuracy.masks} masks in {accuracy.samples} "
            f"held-out samples): the model {accuracy.model:.3f}, the unigram guess (always "
            f"{shown(tokenizer, accuracy.unigram_token)}, the most frequent token of the "
            f"training split) {accuracy.unigram:.3f}: {ratio:.1f}x"
            + ("" if ratio >= LEARNED else ". Not much beyond word frequencies yet: train on "
               "with DEMO_STEPS=4000 make demo")]


def starts_a_word(tokenizer: Tokenizer, token: int) -> bool:
    """A token of letters with its leading space (byte-level BPE's Ġ)."""
    text = tokenizer.id_to_token(token)
    return text.startswith("Ġ") and text[1:].isalpha() and len(text) > 2


def word_to_mask(ids: list, tokenizer: Tokenizer):
    """The position of the first whole word (one token, the next one starting another word or
    punctuation) at or after the middle of a sentence of SENTENCE_TOKENS tokens; else None."""
    if not SENTENCE_TOKENS[0] <= len(ids) <= SENTENCE_TOKENS[1]:
        return None
    return next((p for p in range(len(ids) // 2, len(ids) - 1)
                 if starts_a_word(tokenizer, ids[p])
                 and not tokenizer.id_to_token(ids[p + 1])[0].isalpha()), None)


def held_out_sentences(data: str, tokenizer: Tokenizer) -> list:
    """[(token ids, position)] of the first SENTENCES validation sentences that have a
    word_to_mask: chosen from the data alone, the same whatever the model."""
    valid, chosen = IndexedDataset(os.path.join(data, "valid")), []
    for i in range(len(valid)):
        ids = valid[i].tolist()
        position = word_to_mask(ids, tokenizer)
        if position is not None:
            chosen.append((ids, position))
        if len(chosen) == SENTENCES:
            break
    return chosen


def rank_and_probability(probabilities: torch.Tensor, token: int) -> tuple:
    """(1 + the number of tokens more probable than `token`, its probability)."""
    probability = probabilities[token]
    return 1 + int((probabilities > probability).sum()), probability.item()


def sentence_lines(model, data: str, tokenizer: Tokenizer, unigram: torch.Tensor) -> list:
    """Each held-out sentence with its word masked: the true word's rank and probability by
    the model and by the unigram, and the model's TOP guesses."""
    vocab = Vocabulary.from_data_dir(data)
    by_unigram = unigram.double() / unigram.sum()
    candidates = vocab.size - len(vocab.special)
    sentences = held_out_sentences(data, tokenizer)
    lines = ["", f"Held-out sentences, chosen from the data alone: the first {len(sentences)} "
                 f"validation sentences of {SENTENCE_TOKENS[0]} to {SENTENCE_TOKENS[1]} tokens "
                 "with a one-token word from their middle on, the first such word masked.",
             f"The true word's rank among {candidates} tokens and its probability, by the model "
             "and by the unigram:"]
    for ids, position in sentences:
        masked = [vocab.cls, *ids[:position], vocab.mask, *ids[position + 1:], vocab.sep]
        with torch.no_grad():
            logits = model(torch.tensor([masked]))[0, position + 1, :vocab.size].float()
        logits[list(vocab.special)] = -torch.inf
        by_model = logits.softmax(-1)
        true = ids[position]
        model_rank, model_p = rank_and_probability(by_model, true)
        unigram_rank, unigram_p = rank_and_probability(by_unigram, true)
        top = by_model.topk(TOP)
        guesses = ", ".join(f"{shown(tokenizer, t)} {p:.2f}"
                            for p, t in zip(top.values.tolist(), top.indices.tolist()))
        text = (tokenizer.decode(ids[:position]) + " [MASK]"
                + tokenizer.decode(ids[position + 1:]))
        lines += [f"  {text.strip()}",
                  f"    true {shown(tokenizer, true)}   model: rank {model_rank}, p {model_p:.2g}"
                  f"   unigram: rank {unigram_rank}, p {unigram_p:.2g}",
                  f"    the model's top {TOP}: {guesses}"]
    return lines


def exported_model(out: str) -> tuple:
    """(model in eval mode, its ModelConfig, the folder): the run's latest checkpoint exported
    (OUT/export, the Hugging Face format) and read back."""
    folder = os.path.join(out, "export")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        export(out, folder)  # DeepSpeed's lines and progress bar while it reads ZeRO's shards
    model, config, _ = load_exported(folder)
    return model.eval(), config, folder


def report(out: str, data: str) -> str:
    """What the run's latest checkpoint, exported and read back, shows."""
    model, config, folder = exported_model(out)
    tokenizer = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    unigram = unigram_counts(data)
    accuracy = masked_word_accuracy(model, data, out, config.seq_length, unigram)
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    lines = ["", f"The model: the run's latest checkpoint, exported to {folder}.",
             *learning_lines(accuracy, validations(out), tokenizer),
             *sentence_lines(model, data, tokenizer, unigram), "",
             f"Curves, attention maps: {tensorboard} --logdir {os.path.join(out, 'tensorboard')}"
             " (its valid/accuracy counts every position chosen for masking, "
             f"{1 - BERT_MASKING.mask - BERT_MASKING.random:.0%} of them left as they were)"]
    return "\n".join(lines)
