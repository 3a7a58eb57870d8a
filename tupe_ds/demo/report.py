"""What `make demo` shows after training: how validation went against the most-frequent-token
baseline, the model filling masks in held-out sentences, and the TensorBoard command."""

import argparse
import contextlib
import io
import json
import os
import sys

import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from tupe_ds.data.loader import MaskedSamples, Vocabulary
from tupe_ds.data.masking import BERT_MASKING, IGNORE_INDEX
from tupe_ds.data.packing import PackedSentences
from tupe_ds.export.read import load_exported
from tupe_ds.export.write import export
from tupe_ds.train.flags import index_cache

SENTENCES = 3  # held-out sentences filled
TOP = 3  # predictions shown per mask
EVAL_SAMPLES = 256
EVAL_SEED = 7  # the masks of the held-out samples: the same in every report


def validations(out: str) -> list:
    """[(step, loss)] of the run's validations, in order (a resumed run's too)."""
    found = {}
    with open(os.path.join(out, "train_log.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "valid/loss" in row:
                found[row["step"]] = row["valid/loss"]
    return sorted(found.items())


def held_out_batch(data: str, out: str, seq_len: int):
    """Up to EVAL_SAMPLES valid samples, masked alike in every report; their sample index from
    where the run keeps it (flags.index_cache)."""
    vocab = Vocabulary.from_data_dir(data)
    cache = index_cache(argparse.Namespace(index_cache=None, out=out), data)
    packed = PackedSentences(os.path.join(data, "valid"), seq_len, vocab.cls, vocab.sep, cache)
    samples = MaskedSamples(packed, vocab, BERT_MASKING, seed=EVAL_SEED)
    return samples.global_samples(0, min(EVAL_SAMPLES, len(packed)))


def masked_word_accuracy(model, data: str, out: str, seq_len: int) -> tuple:
    """(the model's accuracy, always guessing the most frequent answer's, that token, samples)
    at the [MASK] positions of held_out_batch. The training's valid/accuracy counts every chosen
    position, 10% of which show their own token (BERT's 80/10/10): copying them is not learning,
    so this counts the masked ones only."""
    vocab = Vocabulary.from_data_dir(data)
    batch = held_out_batch(data, out, seq_len)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])
    masked = (batch["input_ids"] == vocab.mask) & (batch["labels"] != IGNORE_INDEX)
    answers = batch["labels"][masked]
    guessed = logits[masked][:, :vocab.size].argmax(-1)
    counts = torch.bincount(answers, minlength=vocab.size)
    return ((guessed == answers).float().mean().item(), (counts.max() / counts.sum()).item(),
            int(counts.argmax()), len(batch["input_ids"]))


def learning_lines(out: str, data: str, model, seq_len: int, tokenizer: Tokenizer) -> list:
    accuracy, baseline, token, samples = masked_word_accuracy(model, data, out, seq_len)
    ratio = accuracy / baseline
    return ["", "Validation loss (held-out text): " + ", ".join(
                f"step {step} {loss:.3f}" for step, loss in validations(out)),
            f"Masked words guessed right ({samples} held-out samples): the model "
            f"{accuracy:.3f}; always guessing the most frequent answer "
            f"({tokenizer.id_to_token(token)!r}) {baseline:.3f}: {ratio:.1f}x"
            + ("" if ratio >= 1.5 else ". Not much beyond word frequencies yet: train on "
               "(DEMO_STEPS=4000 make demo)")]


def starts_a_word(tokenizer: Tokenizer, token: int) -> bool:
    """A token of letters with its leading space (byte-level BPE's Ġ)."""
    text = tokenizer.id_to_token(token)
    return text.startswith("Ġ") and text[1:].isalpha() and len(text) > 2


def held_out_sentences(data: str, tokenizer: Tokenizer) -> list:
    """[(token ids, position)] of the first SENTENCES validation sentences of 8 to 40 tokens
    with a whole word (one token, the next one starting another word or punctuation) at or
    after their middle: that word is masked."""
    valid, chosen = IndexedDataset(os.path.join(data, "valid")), []
    for i in range(len(valid)):
        ids = valid[i].tolist()
        if not 8 <= len(ids) <= 40:
            continue
        position = next((p for p in range(len(ids) // 2, len(ids) - 1)
                         if starts_a_word(tokenizer, ids[p])
                         and not tokenizer.id_to_token(ids[p + 1])[0].isalpha()), None)
        if position is not None:
            chosen.append((ids, position))
        if len(chosen) == SENTENCES:
            break
    return chosen


def fill_mask_lines(model, data: str, tokenizer: Tokenizer, folder: str) -> list:
    """The model's top predictions for one masked word in each held-out sentence."""
    vocab = Vocabulary.from_data_dir(data)
    lines = ["", f"Filling a masked word in held-out sentences (the exported model, {folder}):"]
    for ids, position in held_out_sentences(data, tokenizer):
        masked = [vocab.cls, *ids[:position], vocab.mask, *ids[position + 1:], vocab.sep]
        with torch.no_grad():
            logits = model(torch.tensor([masked]))[0, position + 1, :vocab.size].float()
        logits[list(vocab.special)] = -torch.inf
        top = logits.softmax(-1).topk(TOP)
        text = (tokenizer.decode(ids[:position]) + " [MASK]"
                + tokenizer.decode(ids[position + 1:]))
        guesses = ", ".join(f"{tokenizer.decode([t]).strip()!r} {p:.2f}"
                            for p, t in zip(top.values.tolist(), top.indices.tolist()))
        lines += [f"  {text.strip()}",
                  f"    true: {tokenizer.decode([ids[position]]).strip()!r}   model: {guesses}"]
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
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    lines = [*learning_lines(out, data, model, config.seq_length, tokenizer),
             *fill_mask_lines(model, data, tokenizer, folder), "",
             f"Curves, attention maps: {tensorboard} --logdir {os.path.join(out, 'tensorboard')}"]
    return "\n".join(lines)
