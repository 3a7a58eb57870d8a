"""tupe_ds.demo: what `make demo` shows agrees with itself. One accuracy, at the [MASK] positions
only (a model that copies its input scores 0 there, one that knows the answers 1), next to the
unigram guess's; held-out sentences chosen from the data alone, each with the true word's rank and
probability by the model next to the unigram's; the training's own accuracy and TensorBoard
command left out of the screen, the report's command said once."""

import re

import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import IGNORE_INDEX
from tupe_ds.demo import report as demo_report
from tupe_ds.demo.run import on_screen

SEQ = 64
# A number as the report writes it (f"{x:.2g}" included: 0.0012, 1e-05, 1)
NUMBER = r"(\d[\d.e+-]*)"


def one_hot(ids, size):
    return torch.nn.functional.one_hot(ids.clamp(min=0), size).float()


def test_unigram_counts_every_token_of_the_training_split(data):
    train = IndexedDataset(f"{data}/train")
    expected = torch.zeros(Vocabulary.from_data_dir(data).size, dtype=torch.int64)
    for i in range(len(train)):
        expected += torch.bincount(torch.from_numpy(train[i].astype("int64")),
                                   minlength=len(expected))
    assert torch.equal(demo_report.unigram_counts(data), expected)


def test_masked_word_accuracy_counts_mask_positions_only(data, tmp_path):
    vocab = Vocabulary.from_data_dir(data)
    unigram = demo_report.unigram_counts(data)
    batch = demo_report.held_out_batch(data, str(tmp_path), SEQ)
    masked = (batch["input_ids"] == vocab.mask) & (batch["labels"] != IGNORE_INDEX)
    answers = batch["labels"][masked]

    def copying(input_ids, attention_mask):  # right at every kept position, wrong at [MASK]
        return one_hot(input_ids, vocab.size)

    def knowing(input_ids, attention_mask):  # the answers, where there are answers
        return one_hot(torch.where(batch["labels"] == IGNORE_INDEX, input_ids, batch["labels"]),
                       vocab.size)

    out = str(tmp_path)
    accuracy = demo_report.masked_word_accuracy(copying, data, out, SEQ, unigram)
    assert accuracy.model == 0 and accuracy.samples == len(batch["input_ids"])
    assert accuracy.masks == int(masked.sum()) < int((batch["labels"] != IGNORE_INDEX).sum())
    assert accuracy.unigram_token == int(unigram.argmax())
    assert accuracy.unigram == (answers == accuracy.unigram_token).float().mean().item()
    assert 0 < accuracy.unigram < 0.2
    # frequencies whose top token is not the held-out answers' most frequent: its guess it is
    second = int(torch.bincount(answers).topk(2).indices[1])
    made_up = torch.nn.functional.one_hot(torch.tensor(second), vocab.size)
    accuracy = demo_report.masked_word_accuracy(copying, data, out, SEQ, made_up)
    assert accuracy.unigram_token == second
    assert accuracy.unigram == (answers == second).float().mean().item() > 0
    assert demo_report.masked_word_accuracy(knowing, data, out, SEQ, unigram).model == 1


def test_the_accuracy_line_names_its_positions_and_sets_it_beside_the_unigrams(data):
    tokenizer = Tokenizer.from_file(f"{data}/tokenizer.json")
    the = tokenizer.token_to_id("Ġthe")
    learned = demo_report.MaskedWordAccuracy(model=0.142, unigram=0.035, unigram_token=the,
                                             samples=256, masks=1970)
    lines = demo_report.learning_lines(learned, [(250, 5.1234), (500, 4.5)], tokenizer)
    assert lines[1] == "Validation loss (held-out text): step 250 5.123, step 500 4.500"
    assert lines[2] == ("Accuracy at the [MASK] positions only (1970 masks in 256 held-out "
                        "samples): "
                        "the model 0.142, the unigram guess (always 'the', the most frequent "
                        "token of the training split) 0.035: 4.1x")
    not_yet = demo_report.learning_lines(learned._replace(model=0.04), [], tokenizer)[2]
    assert not_yet.endswith(") 0.035: 1.1x. Not much beyond word frequencies yet: train on with "
                            "DEMO_STEPS=4000 make demo")


def test_held_out_sentences_are_the_first_with_a_whole_word_to_mask(data):
    tokenizer = Tokenizer.from_file(f"{data}/tokenizer.json")
    chosen = demo_report.held_out_sentences(data, tokenizer)
    assert len(chosen) == demo_report.SENTENCES
    valid = [ids.tolist() for ids in IndexedDataset(f"{data}/valid")]
    last = valid.index(chosen[-1][0])
    eligible = [(ids, demo_report.word_to_mask(ids, tokenizer)) for ids in valid[:last + 1]]
    assert [(ids, at) for ids, at in eligible if at is not None] == chosen
    assert last >= len(chosen)  # some were passed over: the rule is put to the test
    for ids, position in chosen:
        word, after = (tokenizer.id_to_token(i) for i in ids[position:position + 2])
        assert word.startswith("Ġ") and word[1:].isalpha() and not after[0].isalpha()
        assert position >= len(ids) // 2 and 8 <= len(ids) <= 40


def test_rank_counts_the_tokens_more_probable():
    probabilities = torch.tensor([0.1, 0.5, 0.1, 0.3], dtype=torch.float64)
    assert demo_report.rank_and_probability(probabilities, 1) == (1, 0.5)
    assert demo_report.rank_and_probability(probabilities, 0) == (3, 0.1)
    assert demo_report.rank_and_probability(probabilities, 2)[0] == 3  # a tie shares its rank


def sentence_figures(lines: list) -> list:
    """[(true word, model rank, model p, unigram rank, unigram p)] of sentence_lines."""
    pattern = rf"    true ('.+')   model: rank (\d+), p {NUMBER}   unigram: rank (\d+), p {NUMBER}"
    found = [re.fullmatch(pattern, line) for line in lines[4::3]]
    assert all(found), lines
    return [(m[1], int(m[2]), float(m[3]), int(m[4]), float(m[5])) for m in found]


def test_sentence_lines_set_the_models_rank_and_probability_beside_the_unigrams(data):
    tokenizer = Tokenizer.from_file(f"{data}/tokenizer.json")
    vocab = Vocabulary.from_data_dir(data)
    unigram = demo_report.unigram_counts(data)
    candidates = vocab.size - len(vocab.special)

    def unigram_model(input_ids):  # its guesses: the training split's frequencies
        return unigram.double().log().expand(*input_ids.shape, -1)

    def uniform_model(input_ids):
        return torch.zeros(*input_ids.shape, vocab.size)

    as_unigram = demo_report.sentence_lines(unigram_model, data, tokenizer, unigram)
    as_uniform = demo_report.sentence_lines(uniform_model, data, tokenizer, unigram)
    assert len(as_unigram) == 3 + 3 * demo_report.SENTENCES
    assert as_unigram[1].startswith("Held-out sentences, chosen from the data alone: the first 3 ")
    assert as_unigram[2] == (f"The true word's rank among {candidates} tokens and its "
                             "probability, by the model and by the unigram:")
    assert as_unigram[3::3] == as_uniform[3::3]  # the same sentences whatever the model
    texts = [tokenizer.decode(ids[:position]).strip() + " [MASK]"
             for ids, position in demo_report.held_out_sentences(data, tokenizer)]
    assert all(line.startswith(f"  {text}") for line, text in zip(as_unigram[3::3], texts))
    for _, model_rank, model_p, unigram_rank, unigram_p in sentence_figures(as_unigram):
        assert (model_rank, model_p) == (unigram_rank, unigram_p)
        assert model_rank > 1  # the masked words are not the most frequent token
    frequent = ", ".join(f"{demo_report.shown(tokenizer, t)} {c / unigram.sum():.2f}"
                         for c, t in zip(*unigram.topk(3)))
    assert as_unigram[5::3] == [f"    the model's top 3: {frequent}"] * demo_report.SENTENCES
    sentences = demo_report.held_out_sentences(data, tokenizer)
    for (ids, position), figures in zip(sentences, sentence_figures(as_uniform)):
        true, model_rank, model_p, unigram_rank, unigram_p = figures
        assert model_rank == 1 and model_p == float(f"{1 / candidates:.2g}")
        count = unigram[ids[position]]
        assert true == demo_report.shown(tokenizer, ids[position])
        assert unigram_rank == 1 + int((unigram > count).sum())
        assert unigram_p == float(f"{count / unigram.sum():.2g}")


def test_the_screen_drops_the_trainings_accuracy_and_tensorboard_command():
    assert on_screen("step 250 valid/accuracy 0.2247 valid/loss 5.1234\n") == \
        "step 250 valid/loss 5.1234\n"
    assert on_screen("tensorboard --logdir build/demo-run/tensorboard\n") is None
    for line in ("step  300/2500 | loss 4.9000 | lr 3.000e-03 | grad norm 0.812 | 546.6 samples/s "
                 "| 34982 tokens/s | elapsed 0:01:02 | ETA 0:07:40 | skipped 0\n",
                 "final valid loss 5.1234 at step 2500\n"):
        assert on_screen(line) == line
