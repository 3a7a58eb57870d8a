"""Tests of tupe_ds.data: FULL-SENTENCES packing, dynamic masking and the per-rank batch stream.

Packing: samples are whole consecutive sentences, greedy within the length budget, with a [SEP]
between documents and an over-long sentence cut alone into its own sample; no sentence is lost or
repeated. Masking: the share of chosen tokens and the mask/random/keep split of BERT and ELECTRA,
special tokens untouched, labels, the range of random replacements. Loader: the global batches
are the same whatever the data-parallel size and gradient accumulation, every epoch visits every
sample once, and a stream resumed at step s continues exactly where an uninterrupted one is.
"""

import os

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tupe_ds.data.loader import MaskedSamples, TrainBatches, Vocabulary, collate, valid_batches
from tupe_ds.data.masking import (BERT_MASKING, ELECTRA_MASKING, IGNORE_INDEX, MaskingScheme,
                                  mask_tokens)
from tupe_ds.data.packing import PackedSentences, pack

CLS, SEP = 2, 3
SEQ_LEN = 64
SEED = 1234


# --- helpers ---------------------------------------------------------------------------------

def write_indexed_dataset(prefix, documents):
    """documents: [[sentence token ids, ...], ...] -> prefix.bin / prefix.idx."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sentences in documents:
        tokens = np.array([t for sentence in sentences for t in sentence], dtype=np.int32)
        builder.add_document(tokens, [len(sentence) for sentence in sentences])
    builder.finalize(prefix + ".idx")


def documents_crossed(document_starts, first, last):
    """How many documents start strictly inside the sentence range [first, last)."""
    starts = np.asarray(document_starts[1:-1])
    return int(np.sum((starts > first) & (starts < last)))


def packed_cost(lengths, document_starts, first, last):
    """Tokens of sentences [first, last) plus one separator per document boundary crossed."""
    return int(np.sum(lengths[first:last])) + documents_crossed(document_starts, first, last)


def random_documents(rng, sentences, max_length):
    """(sentence lengths, document starts as IndexedDataset.document_indices) drawn at random."""
    lengths = rng.integers(0, max_length + 1, size=sentences)
    inner = rng.choice(np.arange(1, sentences), size=rng.integers(0, sentences // 2), replace=False)
    return lengths, np.concatenate([[0], np.sort(inner), [sentences]]).astype(np.int64)


def assert_valid_packing(samples, lengths, document_starts, budget):
    """Contiguous cover of all sentences in order, within budget unless one over-long sentence,
    and greedy: the next sentence would not have fitted in the sample before it."""
    assert samples[0, 0] == 0 and samples[-1, 1] == len(lengths)
    assert np.array_equal(samples[1:, 0], samples[:-1, 1])
    assert np.all(samples[:, 1] > samples[:, 0])
    for first, last in samples:
        cost = packed_cost(lengths, document_starts, first, last)
        assert cost <= budget or (last - first == 1 and lengths[first] > budget)
    for first, last in samples[:-1]:
        assert packed_cost(lengths, document_starts, first, last + 1) > budget


def original_tokens(inputs, labels):
    """The unmasked sample: the labels where chosen, the inputs elsewhere."""
    return np.where(labels != IGNORE_INDEX, labels, inputs)


def masking_outcomes(sample_count, scheme, mask_id, random_low, random_high, seed=0):
    """Over `sample_count` samples of 1000 tokens of ids >= random_high (so a random
    replacement always differs from the original): counts of chosen positions turned into
    [MASK], replaced at random, and kept, and the random ids drawn."""
    rng = np.random.default_rng(seed)
    special = np.array([0, CLS, SEP])
    counts = {"mask": 0, "random": 0, "keep": 0}
    drawn = []
    for _ in range(sample_count):
        tokens = rng.integers(random_high, random_high + 500, size=1000)
        tokens[[0, -1]] = CLS, SEP
        inputs, labels = mask_tokens(tokens, rng, scheme, mask_id, random_low, random_high,
                                     special)
        chosen = labels != IGNORE_INDEX
        masked = inputs[chosen] == mask_id
        kept = inputs[chosen] == tokens[chosen]
        counts["mask"] += int(masked.sum())
        counts["keep"] += int(kept.sum())
        counts["random"] += int((~masked & ~kept).sum())
        drawn.append(inputs[chosen][~masked & ~kept])
    return counts, np.concatenate(drawn)


def read_steps(batches, steps):
    """The next `steps` optimizer steps of a TrainBatches: a list of lists of micro-batches."""
    return [list(batches.next_step()) for _ in range(steps)]


def concatenated(micro_batches):
    """Micro-batches joined along the batch dimension."""
    return {key: torch.cat([batch[key] for batch in micro_batches])
            for key in micro_batches[0]}


def assert_same_batch(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(data):
    return Vocabulary.from_data_dir(data)


@pytest.fixture(scope="module")
def packed_train(data, vocab):
    return PackedSentences(os.path.join(data, "train"), SEQ_LEN, vocab.cls, vocab.sep)


@pytest.fixture(scope="module")
def packed_valid(data, vocab):
    return PackedSentences(os.path.join(data, "valid"), SEQ_LEN, vocab.cls, vocab.sep)


@pytest.fixture(scope="module")
def train_samples(packed_train, vocab):
    return MaskedSamples(packed_train, vocab, BERT_MASKING, SEED)


@pytest.fixture
def process_samples(data, vocab):
    """process_samples(split): a split's samples as one more process (a rank) would open them."""

    def open_samples(split="train"):
        packed = PackedSentences(os.path.join(data, split), SEQ_LEN, vocab.cls, vocab.sep)
        return MaskedSamples(packed, vocab, BERT_MASKING, SEED)

    return open_samples


@pytest.fixture(scope="module")
def valid_samples(packed_valid, vocab):
    return MaskedSamples(packed_valid, vocab, BERT_MASKING, SEED)


# --- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, document_starts, expected", [
    ([3, 4, 1, 6], [0, 4], [[0, 3], [3, 4]]),
    ([3, 4, 1, 6], [0, 2, 4], [[0, 2], [2, 4]]),
    ([2, 20, 3, 1], [0, 4], [[0, 1], [1, 2], [2, 4]]),
    ([20], [0, 1], [[0, 1]]),
    ([1, 1, 1, 1], [0, 1, 2, 3, 4], [[0, 4]]),
    ([1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [[0, 4], [4, 5]]),
])
def test_pack_hand_made(lengths, document_starts, expected):
    samples = pack(np.array(lengths), np.array(document_starts), budget=8)
    assert samples.tolist() == expected


def test_pack_random_inputs_cover_every_sentence_once_greedily_within_budget():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths, document_starts = random_documents(rng, int(rng.integers(2, 60)), 14)
        budget = int(rng.integers(4, 20))
        assert_valid_packing(pack(lengths, document_starts, budget), lengths, document_starts,
                             budget)


def test_pack_empty_dataset_has_no_sample():
    assert pack(np.zeros(0, dtype=np.int64), np.array([0]), budget=8).shape == (0, 2)


def test_packed_sentences_hand_made_samples(tmp_path):
    documents = [[[11, 12, 13], [14, 15, 16, 17]],
                 [[21], [22, 23]],
                 [[31, 32]],
                 [[41] * 12],
                 [[51, 52]]]
    prefix = str(tmp_path / "hand")
    write_indexed_dataset(prefix, documents)
    packed = PackedSentences(prefix, seq_len=10, cls_id=CLS, sep_id=SEP)
    assert [packed[k].tolist() for k in range(len(packed))] == [
        [CLS, 11, 12, 13, 14, 15, 16, 17, SEP],
        [CLS, 21, 22, 23, SEP, 31, 32, SEP],
        [CLS] + [41] * 8 + [SEP],
        [CLS, 51, 52, SEP],
    ]
    assert all(packed[k].dtype == np.int64 for k in range(len(packed)))


def test_packed_sentences_of_the_corpus(packed_train):
    dataset, budget = packed_train.dataset, SEQ_LEN - 2
    lengths, document_starts = dataset.sequence_lengths, dataset.document_indices
    assert lengths.max() > budget and len(document_starts) > 100
    assert_valid_packing(packed_train.samples, lengths, document_starts, budget)
    seen_documents_crossed = 0
    for k, (first, last) in enumerate(packed_train.samples):
        tokens = packed_train[k]
        assert len(tokens) <= SEQ_LEN and tokens[0] == CLS and tokens[-1] == SEP
        interior = tokens[1:-1]
        sentences = np.concatenate([dataset[s] for s in range(first, last)])
        if last - first == 1 and lengths[first] > budget:
            assert len(tokens) == SEQ_LEN
            assert np.array_equal(interior, sentences[:budget])
            continue
        separators = interior == SEP
        assert np.array_equal(interior[~separators], sentences)
        crossed = documents_crossed(document_starts, first, last)
        assert separators.sum() == crossed
        seen_documents_crossed += crossed
    assert seen_documents_crossed > 0


# --- masking ---------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme, mask_share, random_share", [
    (BERT_MASKING, 0.8, 0.1),
    (ELECTRA_MASKING, 0.85, 0.0),
])
def test_mask_random_keep_split(scheme, mask_share, random_share):
    counts, drawn = masking_outcomes(1350, scheme, mask_id=4, random_low=7, random_high=1000)
    chosen = sum(counts.values())
    assert chosen == 1350 * round(0.15 * 998)
    assert chosen >= 200_000
    assert abs(counts["mask"] / chosen - mask_share) < 0.005
    assert abs(counts["random"] / chosen - random_share) < 0.005
    assert abs(counts["keep"] / chosen - (1 - mask_share - random_share)) < 0.005
    if random_share == 0:
        assert counts["random"] == 0
    else:
        assert drawn.min() >= 7 and drawn.max() < 1000


def test_random_replacements_cover_exactly_the_range():
    every_chosen_random = MaskingScheme(probability=0.5, mask=0.0, random=1.0)
    counts, drawn = masking_outcomes(20, every_chosen_random, mask_id=4, random_low=10,
                                     random_high=13)
    assert counts["mask"] == 0 and counts["keep"] == 0
    assert sorted(set(drawn.tolist())) == [10, 11, 12]


@pytest.mark.parametrize("candidates, chosen", [
    (1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (12, 2), (20, 3), (62, 9), (100, 15), (254, 38),
])
def test_chosen_count(candidates, chosen):
    tokens = np.concatenate([[CLS], np.arange(100, 100 + candidates), [SEP, 0, 0]])
    for seed in range(5):
        _, labels = mask_tokens(tokens, np.random.default_rng(seed), BERT_MASKING, 4, 7, 1000,
                                np.array([0, CLS, SEP, 4]))
        assert np.sum(labels != IGNORE_INDEX) == chosen


def test_no_candidate_leaves_the_sample_alone():
    tokens = np.array([CLS, SEP, 0, 0])
    inputs, labels = mask_tokens(tokens, np.random.default_rng(0), BERT_MASKING, 4, 7, 1000,
                                 np.array([0, CLS, SEP]))
    assert np.array_equal(inputs, tokens) and np.all(labels == IGNORE_INDEX)


@pytest.mark.parametrize("scheme", [BERT_MASKING, ELECTRA_MASKING])
def test_specials_untouched_and_labels_at_chosen_positions_only(scheme):
    rng = np.random.default_rng(7)
    special = np.array([0, 1, CLS, SEP, 4, 5, 6])
    touched_specials = 0
    for _ in range(300):
        tokens = rng.integers(7, 1000, size=80)
        tokens[rng.choice(80, size=30, replace=False)] = rng.choice(special, size=30)
        inputs, labels = mask_tokens(tokens, rng, scheme, 4, 7, 1000, special)
        is_special = np.isin(tokens, special)
        chosen = labels != IGNORE_INDEX
        touched_specials += int(np.sum(chosen & is_special))
        assert np.array_equal(inputs[is_special], tokens[is_special])
        assert np.array_equal(labels[chosen], tokens[chosen])
        assert np.array_equal(inputs[~chosen], tokens[~chosen])
        assert chosen.sum() == max(1, round(0.15 * np.sum(~is_special)))
    assert touched_specials == 0


def test_masking_is_a_function_of_the_generator_only():
    tokens = np.arange(7, 207)
    first, second = (mask_tokens(tokens, np.random.default_rng(3), BERT_MASKING, 4, 7, 1000,
                                 np.array([0, CLS, SEP])) for _ in range(2))
    other = mask_tokens(tokens, np.random.default_rng(4), BERT_MASKING, 4, 7, 1000,
                        np.array([0, CLS, SEP]))
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert not np.array_equal(first[1], other[1])


# --- loader ----------------------------------------------------------------------------------

def test_vocabulary_of_the_data_folder(vocab):
    assert (vocab.size, vocab.pad, vocab.cls, vocab.sep, vocab.mask) == (1000, 0, CLS, SEP, 4)
    assert {vocab.pad, vocab.cls, vocab.sep, vocab.mask} <= set(vocab.special)


def test_collate_pads_rows():
    rows = [(np.array([CLS, 9, 4, SEP]), np.array([IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX])),
            (np.array([CLS, SEP]), np.array([IGNORE_INDEX, IGNORE_INDEX]))]
    batch = collate(rows, seq_len=5, pad=0)
    ignore = IGNORE_INDEX
    assert batch["input_ids"].tolist() == [[CLS, 9, 4, SEP, 0], [CLS, SEP, 0, 0, 0]]
    assert batch["labels"].tolist() == [[ignore, ignore, 8, ignore, ignore], [ignore] * 5]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert all(tensor.dtype == torch.int64 for tensor in batch.values())


def test_single_rank_step_is_the_next_global_samples(train_samples, vocab):
    batches = TrainBatches(train_samples, SEQ_LEN, micro_batch=4, grad_accum=2, dp_rank=0,
                           dp_size=1)
    for step, micro_batches in enumerate(read_steps(batches, 3)):
        rows = [train_samples[g] for g in range(step * 8, step * 8 + 8)]
        assert_same_batch(concatenated(micro_batches), collate(rows, SEQ_LEN, vocab.pad))
    assert batches.consumed == 24


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_together_see_the_single_rank_batches(process_samples, dp_size):
    global_batch, steps = 8, 3
    single_rank = TrainBatches(process_samples(), SEQ_LEN, micro_batch=global_batch,
                               grad_accum=1, dp_rank=0, dp_size=1)
    expected = [concatenated(step) for step in read_steps(single_rank, steps)]
    ranks = [TrainBatches(process_samples(), SEQ_LEN, micro_batch=2, grad_accum=4 // dp_size,
                          dp_rank=rank, dp_size=dp_size) for rank in range(dp_size)]
    assert all(rank.global_batch == global_batch for rank in ranks)
    per_rank_steps = [read_steps(rank, steps) for rank in ranks]
    for step in range(steps):
        union = concatenated([batch for rank in per_rank_steps for batch in rank[step]])
        assert_same_batch(union, expected[step])
        assert (union["labels"] != IGNORE_INDEX).sum() > 0
    assert not torch.equal(expected[0]["input_ids"], expected[1]["input_ids"])


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_accumulation_micro_batches_concatenate_to_the_rank_slice(process_samples, dp_rank):
    whole_slice = TrainBatches(process_samples(), SEQ_LEN, micro_batch=4, grad_accum=1,
                               dp_rank=dp_rank, dp_size=2)
    accumulated = TrainBatches(process_samples(), SEQ_LEN, micro_batch=1, grad_accum=4,
                               dp_rank=dp_rank, dp_size=2)
    for whole, micro_batches in zip(read_steps(whole_slice, 2), read_steps(accumulated, 2)):
        assert len(whole) == 1 and len(micro_batches) == 4
        assert all(batch["input_ids"].shape == (1, SEQ_LEN) for batch in micro_batches)
        assert_same_batch(concatenated(micro_batches), whole[0])


def test_every_epoch_visits_every_sample_once_masked_anew(valid_samples, packed_valid):
    count = len(packed_valid)
    expected = sorted(tuple(packed_valid[k].tolist()) for k in range(count))
    epochs = [[valid_samples[g] for g in range(epoch * count, (epoch + 1) * count)]
              for epoch in range(2)]
    for rows in epochs:
        assert sorted(tuple(original_tokens(*row).tolist()) for row in rows) == expected
    first_epoch_order = [tuple(original_tokens(*row).tolist()) for row in epochs[0]]
    second_epoch_order = [tuple(original_tokens(*row).tolist()) for row in epochs[1]]
    assert first_epoch_order != second_epoch_order
    sample = int(valid_samples.order(0)[0])
    first_masking = valid_samples.masked(0, sample)[1]
    assert not np.array_equal(first_masking, valid_samples.masked(1, sample)[1])
    assert np.array_equal(first_masking, valid_samples.masked(0, sample)[1])


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_resumed_stream_continues_the_uninterrupted_one(process_samples, packed_valid, dp_rank):
    global_batch, resume_step, steps = 8, 13, 3
    assert resume_step * global_batch < len(packed_valid) < (resume_step + steps) * global_batch

    def stream(consumed):
        return TrainBatches(process_samples("valid"), SEQ_LEN, micro_batch=2, grad_accum=2,
                            dp_rank=dp_rank, dp_size=2, consumed=consumed)

    uninterrupted = stream(0)
    read_steps(uninterrupted, resume_step)
    expected = read_steps(uninterrupted, steps)
    resumed = stream(resume_step * global_batch)
    for actual_step, expected_step in zip(read_steps(resumed, steps), expected):
        assert len(actual_step) == len(expected_step) == 2
        for actual, wanted in zip(actual_step, expected_step):
            assert_same_batch(actual, wanted)
    assert resumed.consumed == uninterrupted.consumed == (resume_step + steps) * global_batch


def test_resumed_stream_differs_from_a_fresh_one(valid_samples):
    fresh = TrainBatches(valid_samples, SEQ_LEN, micro_batch=4, grad_accum=1, dp_rank=0,
                         dp_size=1)
    resumed = TrainBatches(valid_samples, SEQ_LEN, micro_batch=4, grad_accum=1, dp_rank=0,
                           dp_size=1, consumed=12)
    assert not torch.equal(read_steps(fresh, 1)[0][0]["input_ids"],
                           read_steps(resumed, 1)[0][0]["input_ids"])


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_valid_batches_split_the_first_samples_among_ranks(valid_samples, vocab, dp_size):
    count, micro_batch = 10, 3
    rows_by_sample = {}
    for rank in range(dp_size):
        mine = list(range(rank, count, dp_size))
        batches = list(valid_batches(valid_samples, SEQ_LEN, micro_batch, rank, dp_size, count))
        assert len(batches) == -(-len(mine) // micro_batch)
        rows = concatenated(batches)
        assert rows["input_ids"].shape == (len(batches) * micro_batch, SEQ_LEN)
        padding = rows["attention_mask"][len(mine):]
        assert padding.sum() == 0
        assert torch.all(rows["labels"][len(mine):] == IGNORE_INDEX)
        for row, sample in enumerate(mine):
            rows_by_sample[sample] = {key: value[row] for key, value in rows.items()}
    assert sorted(rows_by_sample) == list(range(count))
    expected = collate([valid_samples.masked(0, g) for g in range(count)], SEQ_LEN, vocab.pad)
    for sample, row in rows_by_sample.items():
        for key in expected:
            assert torch.equal(row[key], expected[key][sample]), (sample, key)
