"""Stage 3, sentence splitting with spaCy, short sentences joined to their neighbour."""

from typing import List

import spacy

# spaCy refuses texts beyond nlp.max_length; longer documents are cut at a space below it.
CHUNK_CHARS = 100_000


class SentenceSplitter:
    """split(text) -> sentences whose " ".join(...) is the text (whitespace already single)."""

    def __init__(self, model: str = "", min_words: int = 4):
        if model:
            try:
                self.nlp = spacy.load(model, exclude=["ner", "lemmatizer", "textcat"])
            except OSError:
                raise ValueError(f"spaCy pipeline {model!r} is not installed; install it or use "
                                 "the default rule-based sentencizer (--spacy-model '')") from None
        else:
            self.nlp = spacy.blank("en")
            self.nlp.add_pipe("sentencizer")
        self.min_words = min_words

    def split(self, text: str) -> List[str]:
        sentences = []
        for chunk in chunks(text, CHUNK_CHARS):
            sentences.extend(s.text.strip() for s in self.nlp(chunk).sents)
        return join_short([s for s in sentences if s], self.min_words)


def chunks(text: str, size: int) -> List[str]:
    pieces = []
    while len(text) > size:
        cut = text.rfind(" ", 0, size)
        cut = size if cut <= 0 else cut
        pieces.append(text[:cut])
        text = text[cut:].lstrip(" ")
    return pieces + [text]


def join_short(sentences: List[str], min_words: int) -> List[str]:
    """Sentences of fewer than min_words words are joined to the next one (the last to the
    previous one), as the paper's cleaning concatenates short sequences."""
    joined: List[str] = []
    pending = ""
    for sentence in sentences:
        pending = f"{pending} {sentence}" if pending else sentence
        if pending.count(" ") + 1 >= min_words:  # whitespace is single spaces by now
            joined.append(pending)
            pending = ""
    if pending:
        if joined:
            joined[-1] = f"{joined[-1]} {pending}"
        else:
            joined.append(pending)
    return joined
