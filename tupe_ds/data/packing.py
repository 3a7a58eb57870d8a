"""Packed FULL-SENTENCES samples over the sentences of a megatron-core IndexedDataset.

Sample k is "[CLS] s_a s_a+1 ... s_b [SEP]": consecutive sentences, as many as fit in seq_len,
crossing document boundaries with a [SEP] between documents (RoBERTa's FULL-SENTENCES, as the
paper trains). A sentence longer than a whole sample is cut to fit. The packing is one greedy
pass over the sentence lengths, written here (megatron-core's helpers pack GPT token streams or
BERT sentence pairs within documents, neither of which this is).
"""

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset


def pack(sentence_lengths: np.ndarray, document_starts: np.ndarray, budget: int) -> np.ndarray:
    """[samples, 2] (first, last + 1) sentence ranges whose tokens, plus one separator per document
    boundary crossed, fit in `budget` tokens."""
    starts = set(document_starts[1:-1].tolist())
    samples, first, used = [], 0, 0
    for sentence, length in enumerate(sentence_lengths.tolist()):
        cost = length + (1 if sentence in starts and sentence > first else 0)
        if sentence > first and used + cost > budget:
            samples.append((first, sentence))
            first, used, cost = sentence, 0, length
        used += cost
    if len(sentence_lengths) > first:
        samples.append((first, len(sentence_lengths)))
    return np.array(samples, dtype=np.int64).reshape(-1, 2)


class PackedSentences:
    """samples[k] -> int64 token ids "[CLS] ... [SEP]", at most seq_len long."""

    def __init__(self, prefix: str, seq_len: int, cls_id: int, sep_id: int):
        self.dataset = IndexedDataset(prefix)
        self.seq_len, self.cls_id, self.sep_id = seq_len, cls_id, sep_id
        self.document_starts = set(self.dataset.document_indices[1:-1].tolist())
        self.samples = pack(self.dataset.sequence_lengths, self.dataset.document_indices, seq_len - 2)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, k: int) -> np.ndarray:
        first, last = self.samples[k]
        pieces = [np.array([self.cls_id])]
        for sentence in range(first, last):
            if sentence in self.document_starts and sentence > first:
                pieces.append(np.array([self.sep_id]))
            pieces.append(self.dataset[sentence])
        tokens = np.concatenate(pieces).astype(np.int64)[: self.seq_len - 1]
        return np.append(tokens, self.sep_id)
