"""tupe_ds.demo.report: the masked-word accuracy `make demo` prints counts the [MASK] positions only
(a model that copies its input scores 0 there, one that knows the answers 1), next to the share
of the most frequent answer; the held-out sentences it fills are masked at a whole word."""

import torch
from tokenizers import Tokenizer

from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import IGNORE_INDEX
from tupe_ds.demo import report as demo_report

SEQ = 64


def one_hot(ids, size):
    return torch.nn.functional.one_hot(ids.clamp(min=0), size).float()


def test_masked_word_accuracy_counts_mask_positions_only(data, tmp_path):
    vocab = Vocabulary.from_data_dir(data)
    batch = demo_report.held_out_batch(data, str(tmp_path), SEQ)
    masked = (batch["input_ids"] == vocab.mask) & (batch["labels"] != IGNORE_INDEX)
    answers = batch["labels"][masked]
    counts = torch.bincount(answers, minlength=vocab.size)

    def copying(input_ids, attention_mask):  # right at every kept position, wrong at [MASK]
        return one_hot(input_ids, vocab.size)

    def knowing(input_ids, attention_mask):  # the answers, where there are answers
        return one_hot(torch.where(batch["labels"] == IGNORE_INDEX, input_ids, batch["labels"]),
                       vocab.size)

    out = str(tmp_path)
    accuracy, baseline, token, samples = demo_report.masked_word_accuracy(copying, data, out, SEQ)
    assert accuracy == 0 and samples == len(batch["input_ids"])
    assert baseline == (counts.max() / counts.sum()).item() and token == int(counts.argmax())
    assert 0 < baseline < 0.2
    assert demo_report.masked_word_accuracy(knowing, data, out, SEQ)[0] == 1


def test_held_out_sentences_mask_a_whole_word(data):
    tokenizer = Tokenizer.from_file(f"{data}/tokenizer.json")
    chosen = demo_report.held_out_sentences(data, tokenizer)
    assert len(chosen) == demo_report.SENTENCES
    for ids, position in chosen:
        word, after = (tokenizer.id_to_token(i) for i in ids[position:position + 2])
        assert word.startswith("Ġ") and word[1:].isalpha() and not after[0].isalpha()
        assert position >= len(ids) // 2
