"""Stage 3, sentence splitting with spaCy, short sentences joined to their neighbour.

Two paths give the same sentences (tests/test_sentences.py checks them on the bundled corpus and
the tests' corpora): "sentencizer", spaCy's pipeline called on the whole text (the reference, and
always the path for a trained --spacy-model), and "fast", the default with the rule-based
sentencizer. The sentencizer starts a sentence at the first token after a token of its
punctuation characters (".", "!", "?", ...) that is neither punctuation nor one of them; spaCy's
tokenizer cuts the text at whitespace and tokenizes each piece on its own, so the fast path finds
the pieces holding such a character with one regular expression, tokenizes only those pieces and
the ones after them until a sentence starts (each distinct piece once, with spaCy's tokenizer),
and never builds a Doc of the whole text: about 5 times less CPU on the bundled corpus. Texts
with whitespace other than single spaces between pieces (not the cleaned text's) take the
reference path.

Scripts written without spaces between words (Chinese, Japanese, Thai, Lao, Khmer, Burmese) need
two more rules, on every path: their sentences end at their sentence punctuation with no space
after it ("。", "!", "?", "។", "။", ... and the closing quotes and brackets after), and Thai and
Lao sentences, written without punctuation, end at a space (`script_segments`). Their words,
for --min-words and --min-sentence-words, are counted by characters (`count_words`).
"""

import collections
import re
from typing import List

import regex
import spacy
from spacy.tokenizer import Tokenizer

# spaCy refuses texts beyond nlp.max_length; longer documents are cut at a space below it.
CHUNK_CHARS = 100_000
# Pieces tokenized by the fast path, kept for reuse; the cache is emptied when it is full.
PIECE_CACHE = 50_000
SPLITTERS = ("fast", "sentencizer")

# Scripts written without spaces between words, and their characters per word as ICU's word
# break (dictionaries) segments them, measured on tests/test_prep_scripts.py's samples and
# spaCy's Chinese and Japanese examples (docs/data.md): a run of their characters counts as its
# characters over these.
CHARS_PER_WORD = {"Han": 1.75, "Hiragana": 1.5, "Katakana": 3.0, "Thai": 3.9, "Lao": 5.0,
                  "Khmer": 5.8, "Myanmar": 5.2}
SCRIPT_CHARS = {script: regex.compile(rf"\p{{sc={script}}}") for script in CHARS_PER_WORD}
UNSPACED = regex.compile("[" + "".join(rf"\p{{sc={script}}}" for script in CHARS_PER_WORD) + "]")
OTHER_WORDS = regex.compile(r"[\p{L}\p{M}\p{N}]+")  # words of spaced scripts beside them
# Where such a script's sentence ends: after sentence punctuation (Unicode's Sentence_Terminal)
# and the closing quotes and brackets after it, when a character of one of these scripts is
# just before the punctuation or just after (no space between); and at a space between two Thai
# or Lao characters.
SCRIPT_SENTENCE_END = regex.compile(
    rf"(?<={UNSPACED.pattern})\p{{Sentence_Terminal}}+[\p{{Pe}}\p{{Pf}}\"']*"
    rf"|\p{{Sentence_Terminal}}+[\p{{Pe}}\p{{Pf}}\"']*(?={UNSPACED.pattern})"
    r"|(?<=[\p{sc=Thai}\p{sc=Lao}]) (?=[\p{sc=Thai}\p{sc=Lao}])")


def count_words(text: str) -> int:
    """The words of `text`: its pieces between whitespace, but in scripts written without spaces
    (CHARS_PER_WORD) their characters over that script's characters per word (at least one
    word), and the runs of letters and digits of other scripts among them. A zero-width space
    changes nothing (cleaning removes it; those scripts are counted by characters)."""
    if text.isascii() or UNSPACED.search(text) is None:
        return len(text.split())
    words = 0
    for piece in text.split():
        if UNSPACED.search(piece) is None:
            words += 1
        else:
            words += len(OTHER_WORDS.findall(UNSPACED.sub(" ", piece)))
    estimate = sum(len(chars.findall(text)) / CHARS_PER_WORD[script]
                   for script, chars in SCRIPT_CHARS.items())
    return words + max(1, round(estimate))


def script_segments(text: str) -> List[str]:
    """The text cut where a sentence of a script written without spaces ends
    (SCRIPT_SENTENCE_END): the pieces, stripped, each split further by spaCy. A text without
    any character of those scripts is its only piece."""
    if text.isascii() or UNSPACED.search(text) is None:
        return [text]
    pieces, start = [], 0
    for end in SCRIPT_SENTENCE_END.finditer(text):
        cut = end.start() if end.group() == " " else end.end()
        pieces.append(text[start:cut].strip())
        start = cut
    pieces.append(text[start:].strip())
    return [piece for piece in pieces if piece]


class SentenceSplitter:
    """split(text) -> the text's sentences, in order, each joined to the next by a space where
    the text has whitespace between them, by nothing where it has none ("。" then the next
    Chinese sentence): so the text, when its whitespace is single spaces.

    splitter: "fast" (default; the sentencizer's sentences without its Doc) or "sentencizer"
    (spaCy's pipeline on the whole text, the reference). A --spacy-model always uses its own
    pipeline."""

    def __init__(self, model: str = "", min_words: int = 4, splitter: str = "fast"):
        if splitter not in SPLITTERS:
            raise ValueError(f"sentence splitter: choose {' or '.join(SPLITTERS)}, "
                             f"not {splitter!r}")
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
        self._fast = None
        if not model and splitter == "fast":
            punct = frozenset(self.nlp.get_pipe("sentencizer").punct_chars)
            if all(len(p) == 1 and not p.isalnum() and not p.isspace() for p in punct):
                self._fast = _FastSentencizer(self.nlp.tokenizer, punct)

    @property
    def splitter(self) -> str:
        return "fast" if self._fast is not None else "sentencizer"

    def split(self, text: str) -> List[str]:
        sentences = []
        for segment in script_segments(text):
            for chunk in chunks(segment, CHUNK_CHARS):
                if (self._fast is not None and " ".join(chunk.split()) == chunk  # single spaces
                        and not self._fast.crosses(chunk)):
                    sentences.extend(self._fast.split(chunk))
                else:
                    sentences.extend(s.text.strip() for s in self.nlp(chunk).sents)
        return join_short(text, [s for s in sentences if s], self.min_words)


class _FastSentencizer:
    """spaCy's Sentencizer.predict over the tokens of the pieces (space-separated) that can
    matter: a piece without any of its punctuation characters can only start a sentence (at its
    first non-punctuation token) and never ends one.

    Tokenizing a piece alone gives its tokens in the whole text except where spaCy's special-case
    matcher (tokenizer.rules written with affixes, e.g. "'s", ":)") finds a pattern across a
    space, which can keep it from applying an overlapping special case ("' 's"): a text where
    that happens (`crosses`) takes the reference path."""

    def __init__(self, tokenizer, punct: frozenset):
        self.tokenizer = tokenizer
        self.punct = punct
        self.search = _char_class(punct).search
        self.pieces = {}
        # The special cases' patterns as the matcher holds them (tokenized without the special
        # cases), the pairs of their tokens that a space could separate, and the spaces where
        # such a pair could meet (the last character of one, the first of the other).
        bare = Tokenizer(tokenizer.vocab, rules={}, prefix_search=tokenizer.prefix_search,
                         suffix_search=tokenizer.suffix_search,
                         infix_finditer=tokenizer.infix_finditer,
                         token_match=tokenizer.token_match, url_match=tokenizer.url_match)
        self.pairs = set()
        for rule in tokenizer.rules:
            if any(c.isspace() for c in rule):
                if rule.isspace() and len(rule) == 1:
                    continue  # the whitespace tokens' own rules
                raise ValueError(f"special case {rule!r} holds whitespace")
            pattern = [t.text for t in bare(rule)]
            self.pairs.update(zip(pattern, pattern[1:]))
        self.pairs_ending = collections.defaultdict(list)
        for a, b in sorted(self.pairs):
            self.pairs_ending[a[-1]].append((a, b))
        before = set(self.pairs_ending)
        after = {b[0] for _, b in self.pairs}
        if any(a[-1].isalnum() and b[0].isalnum() for a, b in self.pairs):
            self.crossing = re.compile(" ").finditer  # every space a candidate (not English's)
        else:  # a match ends at its space: the character after is looked at, not taken
            self.crossing = re.compile(
                f"{_char_class({c for c in before if not c.isalnum()}).pattern} "
                f"(?={_char_class(after).pattern})|{_char_class(before).pattern} "
                f"(?={_char_class({c for c in after if not c.isalnum()}).pattern})").finditer

    def tokens(self, piece: str) -> list:
        """(offset in the piece, text, in punct_chars, starts a sentence after one) of each
        token of the piece, tokenized alone."""
        tokens = self.pieces.get(piece)
        if tokens is None:
            if len(self.pieces) >= PIECE_CACHE:
                self.pieces.clear()
            punct = self.punct
            tokens = self.pieces[piece] = [
                (t.idx, t.text, t.text in punct, not t.is_punct and t.text not in punct)
                for t in self.tokenizer(piece)]
        return tokens

    def crosses(self, text: str) -> bool:
        """Whether a special case's pattern may span a space of `text` and change its tokens:
        each run of pieces joined by spaces where two tokens of a pattern could meet (the piece
        before ends with one, the piece after starts with the next) is tokenized whole and
        compared with its pieces tokenized alone."""
        run_start = run_end = -1
        for space in self.crossing(text):  # a cheap first test, on the characters around
            at = space.end() - 1
            start = text.rfind(" ", 0, at) + 1
            end = text.find(" ", at + 1)
            end = len(text) if end < 0 else end
            before, after = text[start:at], text[at + 1:end]
            if not any(before.endswith(a) and after.startswith(b)
                       for a, b in self.pairs_ending[before[-1]]):
                continue
            if at != run_end:  # not the space after the run's last piece: a new run
                if run_start >= 0 and self._changed(text[run_start:run_end]):
                    return True
                run_start = start
            run_end = end
        return run_start >= 0 and self._changed(text[run_start:run_end])

    def _changed(self, run: str) -> bool:
        alone, at = [], 0
        for piece in run.split(" "):
            alone.extend((at + offset, token) for offset, token, _, _ in self.tokens(piece))
            at += len(piece) + 1
        return alone != [(t.idx, t.text) for t in self.tokenizer(run)]

    def split(self, text: str) -> List[str]:
        """The sentencizer's sentences of `text` (single spaces, no space at either end)."""
        starts = [0]
        seen_period = False
        at, end = 0, len(text)
        while True:
            if seen_period:  # the piece at `at` follows one that ended a sentence
                first = at
                if first >= end:
                    break
            else:
                found = self.search(text, at)
                if found is None:
                    break
                first = text.rfind(" ", 0, found.start()) + 1
            last = text.find(" ", first)
            last = end if last < 0 else last
            piece = text[first:last]
            if seen_period and piece.isalnum():  # one or more word tokens, none punctuation
                starts.append(first)
                seen_period = False
            else:
                for offset, _, in_punct_chars, starter in self.tokens(piece):
                    if seen_period and starter:
                        starts.append(first + offset)
                        seen_period = False
                    elif in_punct_chars:
                        seen_period = True
            at = last + 1
        starts.append(end)
        return [text[a:b].strip() for a, b in zip(starts, starts[1:])]


def _char_class(chars) -> re.Pattern:
    return re.compile("[" + "".join(re.escape(c) for c in sorted(chars)) + "]")


def chunks(text: str, size: int) -> List[str]:
    pieces = []
    while len(text) > size:
        cut = text.rfind(" ", 0, size)
        cut = size if cut <= 0 else cut
        pieces.append(text[:cut])
        text = text[cut:].lstrip(" ")
    return pieces + [text]


def join_short(text: str, sentences: List[str], min_words: int) -> List[str]:
    """Sentences (of `text`, in order) of fewer than min_words words (`count_words`) are joined
    to the next one (the last to the previous one), as the paper's cleaning concatenates short
    sequences: by a space where the text has whitespace between them, else by nothing. The
    words of a joined sentence are its sentences' words summed, each counted once: linear in
    the text (a count of the joined text at each step was quadratic where sentences end inside
    words, "ab.Cd.ab.Cd...", which join by nothing and never reach min_words)."""
    joined: List[str] = []
    pending, pending_gap, words, at = [], "", 0, 0
    for sentence in sentences:
        start = text.index(sentence, at)
        gap = " " if start > at else ""
        at = start + len(sentence)
        if pending:
            pending += [gap, sentence]
        else:
            pending, pending_gap = [sentence], gap
        words += count_words(sentence)
        if words >= min_words:
            joined.append("".join(pending))
            pending, words = [], 0
    if pending:
        if joined:
            joined[-1] = f"{joined[-1]}{pending_gap}{''.join(pending)}"
        else:
            joined.append("".join(pending))
    return joined
