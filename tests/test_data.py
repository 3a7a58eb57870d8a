"""Tests of tupe_ds.data: FULL-SENTENCES packing, dynamic masking and the per-rank batch stream.

Packing: samples are whole consecutive sentences, greedy within the length budget, with a [SEP]
between documents and an over-long sentence cut alone into its own sample; no sentence is lost or
repeated; the compiled packing and the batch reader give exactly the samples of the Python
packing they replaced (`todays_pack`, `todays_sample`, kept here as the oracle). Masking: the
share of chosen tokens and the mask/random/keep split of BERT and ELECTRA, special tokens
untouched, labels, the range of random replacements; a micro-batch masked at once equals its
samples masked alone. Loader: the global batches are the same whatever the data-parallel size,
gradient accumulation, stream (vectorised or per sample) and prefetching, every epoch visits
every sample once, and a stream resumed at any step continues exactly where an uninterrupted
one is. (The sample index cache: test_index_cache.py.)
"""

import os
import time

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tupe_ds.data import counter_random
from tupe_ds.data.loader import TrainBatches, Vocabulary, valid_batches, with_empty_rows
from tupe_ds.data.masking import (BERT_MASKING, ELECTRA_MASKING, IGNORE_INDEX, MaskedSamples,
                                  MaskingIds, MaskingScheme, collate, mask_batch, mask_tokens)
from tupe_ds.data.packing import PackedSentences, pack
from tupe_ds.data.prefetch import Prefetched

CLS, SEP = 2, 3
SEQ_LEN = 64
SEED = 1234
IDS = MaskingIds(mask=4, random_low=7, random_high=1000)


# --- helpers ---------------------------------------------------------------------------------

def write_indexed_dataset(prefix, documents):
    """documents: [[sentence token ids, ...], ...] -> prefix.bin / prefix.idx."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sentences in documents:
        tokens = np.array([t for sentence in sentences for t in sentence], dtype=np.int32)
        builder.add_document(tokens, [len(sentence) for sentence in sentences])
    builder.finalize(prefix + ".idx")


def todays_pack(sentence_lengths, document_starts, budget):
    """The packing tupe_ds ran before the sample index (a Python loop over the sentences)."""
    starts = set(np.asarray(document_starts)[1:-1].tolist())
    samples, first, used = [], 0, 0
    for sentence, length in enumerate(np.asarray(sentence_lengths).tolist()):
        cost = length + (1 if sentence in starts and sentence > first else 0)
        if sentence > first and used + cost > budget:
            samples.append((first, sentence))
            first, used, cost = sentence, 0, length
        used += cost
    if len(sentence_lengths) > first:
        samples.append((first, len(sentence_lengths)))
    return np.array(samples, dtype=np.int64).reshape(-1, 2)


def todays_sample(dataset, first, last, seq_len):
    """The tokens of the sample of sentences [first, last), as tupe_ds read them before."""
    starts = set(dataset.document_indices[1:-1].tolist())
    pieces = [np.array([CLS])]
    for sentence in range(first, last):
        if sentence in starts and sentence > first:
            pieces.append(np.array([SEP]))
        pieces.append(dataset[sentence])
    tokens = np.concatenate(pieces).astype(np.int64)[: seq_len - 1]
    return np.append(tokens, SEP)


def ranges(boundaries):
    """Sample boundaries -> [samples, 2] (first, last + 1) sentence ranges."""
    return np.stack([boundaries[:-1], boundaries[1:]], axis=1)


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


def assert_rows_are_todays_samples(packed, seq_len, pad=0):
    """Every sample of `packed`: its sentence range is todays_pack's, and rows() (in shuffled
    batches of 7) and packed[k] give todays_sample's tokens."""
    dataset = packed.dataset
    expected = todays_pack(dataset.sequence_lengths, dataset.document_indices, seq_len - 2)
    assert np.array_equal(ranges(packed.boundaries), expected)
    order = np.random.default_rng(0).permutation(len(packed))
    for batch in np.array_split(order, max(1, len(order) // 7)):
        tokens, lengths = packed.rows(batch, pad)
        assert tokens.shape == (len(batch), seq_len) and tokens.dtype == np.int64
        for row, k in enumerate(batch):
            wanted = todays_sample(dataset, *expected[k], seq_len)
            assert lengths[row] == len(wanted)
            assert np.array_equal(tokens[row, :lengths[row]], wanted), k
            assert np.all(tokens[row, lengths[row]:] == pad)
            assert np.array_equal(packed[k], wanted)


def original_tokens(inputs, labels):
    """The unmasked sample: the labels where chosen, the inputs elsewhere."""
    return np.where(labels != IGNORE_INDEX, labels, inputs)


def masking_outcomes(sample_count, scheme, ids, seed=0):
    """Over `sample_count` samples of 1000 tokens of ids >= ids.random_high (so a random
    replacement always differs from the original): counts of chosen positions turned into
    [MASK], replaced at random, and kept, and the random ids drawn."""
    rng = np.random.default_rng(seed)
    special = np.array([0, CLS, SEP])
    counts = {"mask": 0, "random": 0, "keep": 0}
    drawn = []
    for sample in range(sample_count):
        tokens = rng.integers(ids.random_high, ids.random_high + 500, size=1000)
        tokens[[0, -1]] = CLS, SEP
        inputs, labels = mask_tokens(tokens, seed, 0, sample, scheme, ids, special)
        chosen = labels != IGNORE_INDEX
        masked = inputs[chosen] == ids.mask
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
def index_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index-cache"))


@pytest.fixture(scope="module")
def open_samples(data, vocab, index_cache):
    """open_samples(split, vectorised): a split's samples as one more process (a rank) would
    open them."""

    def open_split(split="train", vectorised=True, seq_len=SEQ_LEN):
        packed = PackedSentences(os.path.join(data, split), seq_len, vocab.cls, vocab.sep,
                                 index_cache)
        return MaskedSamples(packed, vocab, BERT_MASKING, SEED, vectorised)

    return open_split


@pytest.fixture(scope="module")
def train_samples(open_samples):
    return open_samples("train")


@pytest.fixture(scope="module")
def valid_samples(open_samples):
    return open_samples("valid")


# --- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, document_starts, expected", [
    ([3, 4, 1, 6], [0, 4], [0, 3, 4]),
    ([3, 4, 1, 6], [0, 2, 4], [0, 2, 4]),
    ([2, 20, 3, 1], [0, 4], [0, 1, 2, 4]),
    ([20], [0, 1], [0, 1]),
    ([1, 1, 1, 1], [0, 1, 2, 3, 4], [0, 4]),
    ([1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [0, 4, 5]),
    ([1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 3, 4, 5], [0, 4, 5]),  # empty documents
])
def test_pack_hand_made(lengths, document_starts, expected):
    boundaries = pack(np.array(lengths, dtype=np.int32), np.array(document_starts), budget=8)
    assert boundaries.tolist() == expected


def test_pack_random_inputs_are_todays_packing_greedy_within_budget():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths, document_starts = random_documents(rng, int(rng.integers(2, 60)), 14)
        budget = int(rng.integers(4, 20))
        samples = ranges(pack(lengths.astype(np.int32), document_starts, budget))
        assert np.array_equal(samples, todays_pack(lengths, document_starts, budget))
        assert_valid_packing(samples, lengths, document_starts, budget)


def test_pack_empty_dataset_has_no_sample():
    assert pack(np.zeros(0, dtype=np.int32), np.array([0]), budget=8).tolist() == [0]


def test_packed_sentences_hand_made_samples(tmp_path):
    documents = [[[11, 12, 13], [14, 15, 16, 17]],
                 [[21], [22, 23]],
                 [[31, 32]],
                 [[41] * 12],
                 [[51, 52]]]
    prefix = str(tmp_path / "hand")
    write_indexed_dataset(prefix, documents)
    packed = PackedSentences(prefix, seq_len=10, cls_id=CLS, sep_id=SEP,
                             cache_folder=str(tmp_path))
    expected = [
        [CLS, 11, 12, 13, 14, 15, 16, 17, SEP],
        [CLS, 21, 22, 23, SEP, 31, 32, SEP],
        [CLS] + [41] * 8 + [SEP],
        [CLS, 51, 52, SEP],
    ]
    assert [packed[k].tolist() for k in range(len(packed))] == expected
    tokens, lengths = packed.rows(np.array([3, 1, 2, 0, 1]), pad=0)
    assert lengths.tolist() == [4, 8, 10, 9, 8]
    assert tokens.tolist() == [row + [0] * (10 - len(row)) for row in
                               (expected[3], expected[1], expected[2], expected[0], expected[1])]


@pytest.mark.parametrize("seq_len", [8, 12, 16])
def test_edge_case_corpora_give_todays_samples(tmp_path, seq_len):
    """Sentences longer than a sample, single-sentence documents, empty documents, empty
    sentences, documents starting at a sample's first sentence, at random."""
    rng = np.random.default_rng(seq_len)
    documents = []
    for _ in range(300):
        sentences = int(rng.choice([0, 1, 1, 2, 3, 5]))
        documents.append([rng.integers(100, 200, size=int(rng.choice([0, 1, 3, 6, 9, 15, 30])))
                          .tolist() for _ in range(sentences)])
    prefix = str(tmp_path / "edges")
    write_indexed_dataset(prefix, documents)
    packed = PackedSentences(prefix, seq_len, CLS, SEP, str(tmp_path))
    lengths, starts = packed.dataset.sequence_lengths, packed.dataset.document_indices
    samples = ranges(packed.boundaries)
    assert np.any(lengths > seq_len - 2) and np.any(lengths == 0)
    assert np.any(np.diff(starts) == 0) and np.any(np.diff(starts) == 1)
    assert len(np.intersect1d(samples[1:, 0], starts[1:-1])) > 0
    assert_rows_are_todays_samples(packed, seq_len, pad=9)


@pytest.mark.parametrize("split, seq_len", [("train", SEQ_LEN), ("valid", SEQ_LEN),
                                            ("train", 512)])
def test_samples_of_the_corpus_are_todays(open_samples, split, seq_len):
    packed = open_samples(split, seq_len=seq_len).packed
    dataset, budget = packed.dataset, seq_len - 2
    lengths, document_starts = dataset.sequence_lengths, dataset.document_indices
    assert len(document_starts) > 20
    assert_valid_packing(ranges(packed.boundaries), lengths, document_starts, budget)
    assert_rows_are_todays_samples(packed, seq_len)


def test_samples_cross_documents_with_a_separator(train_samples):
    packed = train_samples.packed
    dataset, budget = packed.dataset, SEQ_LEN - 2
    lengths, document_starts = dataset.sequence_lengths, dataset.document_indices
    assert lengths.max() > budget
    seen_documents_crossed = 0
    for k, (first, last) in enumerate(ranges(packed.boundaries)):
        tokens = packed[k]
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
    counts, drawn = masking_outcomes(1350, scheme, IDS)
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
    counts, drawn = masking_outcomes(20, every_chosen_random,
                                     MaskingIds(mask=4, random_low=10, random_high=13))
    assert counts["mask"] == 0 and counts["keep"] == 0
    assert sorted(set(drawn.tolist())) == [10, 11, 12]
    assert np.all(np.abs(np.bincount(drawn)[10:] / len(drawn) - 1 / 3) < 0.02)


def test_chosen_positions_are_uniform_over_the_candidates():
    tokens = np.concatenate([[CLS], np.arange(100, 140), [SEP]])
    hits = np.zeros(len(tokens))
    for sample in range(4000):
        _, labels = mask_tokens(tokens, SEED, 0, sample, BERT_MASKING, IDS, np.array([CLS, SEP]))
        hits += labels != IGNORE_INDEX
    assert hits[0] == hits[-1] == 0
    share = hits[1:-1] / 4000  # 6 of 40 each time
    assert np.all(np.abs(share - 6 / 40) < 0.03)


@pytest.mark.parametrize("candidates, chosen", [
    (1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (12, 2), (20, 3), (62, 9), (100, 15), (254, 38),
])
def test_chosen_count(candidates, chosen):
    tokens = np.concatenate([[CLS], np.arange(100, 100 + candidates), [SEP, 0, 0]])
    special = np.array([0, CLS, SEP, 4])
    for sample in range(5):
        _, labels = mask_tokens(tokens, SEED, 0, sample, BERT_MASKING, IDS, special)
        assert np.sum(labels != IGNORE_INDEX) == chosen
    is_special = np.isin(np.arange(1000), special)
    batch = np.tile(tokens, (5, 1))
    _, labels = mask_batch(batch, SEED, np.zeros(5, dtype=np.int64), np.arange(5), BERT_MASKING,
                           IDS, is_special)
    assert np.all(np.sum(labels != IGNORE_INDEX, axis=1) == chosen)


def test_no_candidate_leaves_the_sample_alone():
    tokens = np.array([CLS, SEP, 0, 0])
    inputs, labels = mask_tokens(tokens, SEED, 0, 0, BERT_MASKING, IDS, np.array([0, CLS, SEP]))
    assert np.array_equal(inputs, tokens) and np.all(labels == IGNORE_INDEX)
    is_special = np.isin(np.arange(1000), [0, CLS, SEP])
    inputs, labels = mask_batch(tokens[None], SEED, np.zeros(1, dtype=np.int64),
                                np.zeros(1, dtype=np.int64), BERT_MASKING, IDS, is_special)
    assert np.array_equal(inputs[0], tokens) and np.all(labels == IGNORE_INDEX)


@pytest.mark.parametrize("scheme", [BERT_MASKING, ELECTRA_MASKING])
def test_specials_untouched_and_labels_at_chosen_positions_only(scheme):
    rng = np.random.default_rng(7)
    special = np.array([0, 1, CLS, SEP, 4, 5, 6])
    touched_specials = 0
    for sample in range(300):
        tokens = rng.integers(7, 1000, size=80)
        tokens[rng.choice(80, size=30, replace=False)] = rng.choice(special, size=30)
        inputs, labels = mask_tokens(tokens, SEED, 2, sample, scheme, IDS, special)
        is_special = np.isin(tokens, special)
        chosen = labels != IGNORE_INDEX
        touched_specials += int(np.sum(chosen & is_special))
        assert np.array_equal(inputs[is_special], tokens[is_special])
        assert np.array_equal(labels[chosen], tokens[chosen])
        assert np.array_equal(inputs[~chosen], tokens[~chosen])
        assert chosen.sum() == max(1, round(0.15 * np.sum(~is_special)))
    assert touched_specials == 0


@pytest.mark.parametrize("scheme", [BERT_MASKING, ELECTRA_MASKING])
def test_batch_masking_is_each_sample_masked_alone(scheme):
    """Rows of all lengths (padding 0 is special), specials inside, repeated samples, two
    epochs: mask_batch gives row by row what mask_tokens gives for the row's sample."""
    rng = np.random.default_rng(3)
    special = np.array([0, 1, CLS, SEP, 4, 5, 6])
    is_special = np.isin(np.arange(1000), special)
    rows, width = 64, 128
    tokens = rng.integers(7, 1000, size=(rows, width))
    tokens[rng.random((rows, width)) < 0.05] = 5
    lengths = rng.integers(2, width + 1, size=rows)
    tokens[np.arange(width) >= lengths[:, None]] = 0
    epochs, samples = rng.integers(0, 2, size=rows), rng.integers(0, 40, size=rows)
    inputs, labels = mask_batch(tokens, SEED, epochs, samples, scheme, IDS, is_special)
    for row in range(rows):
        alone = mask_tokens(tokens[row], SEED, epochs[row], samples[row], scheme, IDS, special)
        assert np.array_equal(inputs[row], alone[0]) and np.array_equal(labels[row], alone[1])


def test_masking_is_a_function_of_seed_epoch_and_sample():
    tokens = np.arange(7, 207)
    special = np.array([0, CLS, SEP])

    def labels(seed, epoch, sample):
        return mask_tokens(tokens, seed, epoch, sample, BERT_MASKING, IDS, special)[1]

    assert np.array_equal(labels(3, 0, 5), labels(3, 0, 5))
    for other in [(4, 0, 5), (3, 1, 5), (3, 0, 6)]:
        assert not np.array_equal(labels(3, 0, 5), labels(*other)), other


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 17, 1000, 4097])
def test_epoch_order_is_a_permutation(count):
    order = counter_random.permutation(SEED, 0, count, np.arange(count))
    assert sorted(order.tolist()) == list(range(count))
    assert np.array_equal(counter_random.permutation(SEED, 0, count, np.arange(count)[::-1]),
                          order[::-1])
    if count > 4:
        assert not np.array_equal(order, counter_random.permutation(SEED, 1, count,
                                                                    np.arange(count)))
        assert not np.array_equal(order, np.arange(count))


def test_epoch_order_is_not_ordered():
    """Neighbouring positions land far apart: the order shuffles, not shifts."""
    order = counter_random.permutation(SEED, 0, 100_000, np.arange(100_000))
    assert abs(np.corrcoef(np.arange(100_000), order)[0, 1]) < 0.02
    assert np.median(np.abs(np.diff(order))) > 10_000


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


def test_with_empty_rows():
    batch = collate([(np.array([CLS, 9, SEP]), np.array([IGNORE_INDEX, 9, IGNORE_INDEX]))],
                    seq_len=4, pad=0)
    grown = with_empty_rows(batch, 3, pad=0)
    assert grown["input_ids"].tolist() == [[CLS, 9, SEP, 0], [0] * 4, [0] * 4]
    assert grown["attention_mask"][1:].sum() == 0 and torch.all(grown["labels"][1:] == -100)
    assert with_empty_rows(batch, 1, pad=0) is batch


@pytest.mark.parametrize("split", ["train", "valid"])
def test_vectorised_stream_is_the_per_sample_reference(open_samples, split):
    """Two epochs and more of the stream, micro-batch by micro-batch."""
    fast, reference = open_samples(split), open_samples(split, vectorised=False)
    assert fast.vectorised and not reference.vectorised
    count = len(fast.packed)
    stop = count * 2 + 100 if split == "valid" else 1200
    for first in range(0, stop, 50):
        assert_same_batch(fast.global_samples(first, 50), reference.global_samples(first, 50))
    if split == "train":  # an epoch boundary inside a micro-batch
        assert_same_batch(fast.global_samples(count - 5, 10),
                          reference.global_samples(count - 5, 10))


def test_generator_draws_follow_the_sample_not_the_batch(data, vocab, index_cache):
    """ELECTRA's stream: a draw in (0, 1] at every masked position and nowhere else, the same
    whether the sample is read alone, in another micro-batch or by the reference path; uniform."""
    packed = PackedSentences(os.path.join(data, "train"), SEQ_LEN, vocab.cls, vocab.sep,
                             index_cache)
    fast, reference = (MaskedSamples(packed, vocab, ELECTRA_MASKING, SEED, vectorised, draws=True)
                       for vectorised in (True, False))
    whole = fast.global_samples(0, 64)
    draws, labelled = whole["generator_draws"], whole["labels"] != IGNORE_INDEX
    assert draws.dtype == torch.float32 and torch.all(draws[~labelled] == 0)
    assert torch.all((draws[labelled] > 0) & (draws[labelled] <= 1))
    assert abs(draws[labelled].mean().item() - 0.5) < 0.03  # over about 600 draws
    for first, count in ((0, 1), (5, 3), (8, 56)):
        part = fast.global_samples(first, count)["generator_draws"]
        assert torch.equal(part, draws[first:first + count])
    assert_same_batch(reference.global_samples(0, 64), whole)
    assert "generator_draws" not in MaskedSamples(packed, vocab, ELECTRA_MASKING,
                                                  SEED).global_samples(0, 1)


def test_single_rank_step_is_the_next_global_samples(train_samples, vocab):
    batches = TrainBatches(train_samples, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=1)
    for step, micro_batches in enumerate(read_steps(batches, 3)):
        rows = [train_samples[g] for g in range(step * 8, step * 8 + 8)]
        assert_same_batch(concatenated(micro_batches), collate(rows, SEQ_LEN, vocab.pad))
    assert batches.consumed == 24


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_together_see_the_single_rank_batches(open_samples, dp_size):
    global_batch, steps = 8, 3
    single_rank = TrainBatches(open_samples(), micro_batch=global_batch, grad_accum=1, dp_rank=0,
                               dp_size=1)
    expected = [concatenated(step) for step in read_steps(single_rank, steps)]
    ranks = [TrainBatches(open_samples(), micro_batch=2, grad_accum=4 // dp_size, dp_rank=rank,
                          dp_size=dp_size) for rank in range(dp_size)]
    assert all(rank.global_batch == global_batch for rank in ranks)
    per_rank_steps = [read_steps(rank, steps) for rank in ranks]
    for step in range(steps):
        union = concatenated([batch for rank in per_rank_steps for batch in rank[step]])
        assert_same_batch(union, expected[step])
        assert (union["labels"] != IGNORE_INDEX).sum() > 0
    assert not torch.equal(expected[0]["input_ids"], expected[1]["input_ids"])


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_accumulation_micro_batches_concatenate_to_the_rank_slice(open_samples, dp_rank):
    whole_slice = TrainBatches(open_samples(), micro_batch=4, grad_accum=1, dp_rank=dp_rank,
                               dp_size=2)
    accumulated = TrainBatches(open_samples(), micro_batch=1, grad_accum=4, dp_rank=dp_rank,
                               dp_size=2)
    for whole, micro_batches in zip(read_steps(whole_slice, 2), read_steps(accumulated, 2)):
        assert len(whole) == 1 and len(micro_batches) == 4
        assert all(batch["input_ids"].shape == (1, SEQ_LEN) for batch in micro_batches)
        assert_same_batch(concatenated(micro_batches), whole[0])


def test_every_epoch_visits_every_sample_once_masked_anew(valid_samples):
    packed = valid_samples.packed
    count = len(packed)
    expected = sorted(tuple(packed[k].tolist()) for k in range(count))
    epochs = [[valid_samples[g] for g in range(epoch * count, (epoch + 1) * count)]
              for epoch in range(2)]
    for rows in epochs:
        assert sorted(tuple(original_tokens(*row).tolist()) for row in rows) == expected
    first_epoch_order = [tuple(original_tokens(*row).tolist()) for row in epochs[0]]
    second_epoch_order = [tuple(original_tokens(*row).tolist()) for row in epochs[1]]
    assert first_epoch_order != second_epoch_order
    first_masking = valid_samples.masked(0, 0)[1]
    assert not np.array_equal(first_masking, valid_samples.masked(1, 0)[1])
    assert np.array_equal(first_masking, valid_samples.masked(0, 0)[1])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resumed_stream_continues_the_uninterrupted_one_at_any_step(open_samples, prefetch):
    """Resumed at every step of a stream that crosses an epoch boundary, on both ranks."""
    global_batch, steps = 8, 18
    assert 13 * global_batch < len(open_samples("valid").packed) < steps * global_batch

    def stream(dp_rank, consumed):
        return TrainBatches(open_samples("valid"), micro_batch=2, grad_accum=2, dp_rank=dp_rank,
                            dp_size=2, consumed=consumed, prefetch=prefetch)

    for dp_rank in range(2):
        uninterrupted = stream(dp_rank, 0)
        expected = read_steps(uninterrupted, steps)
        uninterrupted.close()
        for resume_step in range(1, steps):
            resumed = stream(dp_rank, resume_step * global_batch)
            for actual_step, expected_step in zip(read_steps(resumed, steps - resume_step),
                                                  expected[resume_step:]):
                assert len(actual_step) == len(expected_step) == 2
                for actual, wanted in zip(actual_step, expected_step):
                    assert_same_batch(actual, wanted)
            assert resumed.consumed == steps * global_batch
            resumed.close()


def test_prefetched_batches_are_the_same_in_the_same_order(open_samples):
    plain = TrainBatches(open_samples(), micro_batch=3, grad_accum=2, dp_rank=1, dp_size=2)
    ahead = TrainBatches(open_samples(), micro_batch=3, grad_accum=2, dp_rank=1, dp_size=2,
                         prefetch=2)
    for plain_step, ahead_step in zip(read_steps(plain, 12), read_steps(ahead, 12)):
        assert len(plain_step) == len(ahead_step) == 2
        for expected, actual in zip(plain_step, ahead_step):
            assert_same_batch(actual, expected)
    assert ahead.consumed == plain.consumed == 12 * 12
    deadline = time.time() + 30  # the thread refills what was read, then waits
    while ahead.ahead.queue.qsize() < 2 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert ahead.ahead.queue.qsize() == 2  # made ahead while nothing was read, and no more
    ahead.close()
    assert not ahead.ahead.thread.is_alive()


def test_prefetch_raises_the_producers_error_and_stops():
    def items():
        yield 1
        raise ValueError("sample 7 is broken")

    prefetched = Prefetched(items(), depth=2, pin=False)
    assert next(prefetched) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="sample 7 is broken"):
            next(prefetched)
    prefetched.close()
    assert list(Prefetched(iter([1, 2, 3]), depth=1, pin=False)) == [1, 2, 3]


def test_resumed_stream_differs_from_a_fresh_one(valid_samples):
    fresh = TrainBatches(valid_samples, micro_batch=4, grad_accum=1, dp_rank=0, dp_size=1)
    resumed = TrainBatches(valid_samples, micro_batch=4, grad_accum=1, dp_rank=0, dp_size=1,
                           consumed=12)
    assert not torch.equal(read_steps(fresh, 1)[0][0]["input_ids"],
                           read_steps(resumed, 1)[0][0]["input_ids"])


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_valid_batches_split_the_first_samples_among_ranks(valid_samples, vocab, dp_size):
    count, micro_batch = 10, 3
    rows_by_sample = {}
    for rank in range(dp_size):
        mine = list(range(rank, count, dp_size))
        batches = list(valid_batches(valid_samples, micro_batch, rank, dp_size, count))
        assert len(batches) == -(-(-(-count // dp_size)) // micro_batch)  # alike on every rank
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

