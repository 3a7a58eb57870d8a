"""data_prep's fast paths against their references: the sentence splitter (data_prep/sentences.py)
against spaCy's sentencizer, the gated Moses normalizer (data_prep/clean.py) against sacremoses'."""

import random

import pytest
from sacremoses import MosesPunctNormalizer

from data_prep.clean import Cleaner, GatedMoses
from data_prep.read import Reader, expand_inputs
from data_prep.sentences import CHUNK_CHARS, SentenceSplitter
from test_data_prep import SAMPLE, near_copy, unique_document

# Characters and pieces where spaCy's tokenizer and the sentencizer have rules: its punctuation,
# quotes, abbreviations, emoticons and contractions (special cases), URLs, numbers.
PIECES = list("ab Ab.!?\"'()[]-,;:…‼。？!%$@#_*<3") + [
    "Mr.", "Dr.", "etc.", "e.g.", "U.S.", "word", "...", "?!", "'s", "n't", ":)", "(-:", "<3",
    "http://x.org/a.b?c=d.", "3.5", "1a.m.", "'", "’s", "o.O", "’", "Cause", "°", "C."]
MOSES_PIECES = list("ab1 2().!:?;,%`'\"„“”–—´‘’‚…«»\u00a0ºCcmn\r<") + ["nº", "  "]


@pytest.fixture(scope="module")
def splitters():
    fast, reference = SentenceSplitter(), SentenceSplitter(splitter="sentencizer")
    assert (fast.splitter, reference.splitter) == ("fast", "sentencizer")
    return fast, reference


@pytest.fixture(scope="module")
def sample():
    return list(Reader().documents(expand_inputs([SAMPLE])))


@pytest.mark.slow
def test_fast_splitter_gives_the_sentencizer_sentences_on_the_bundled_corpus(splitters, sample):
    fast, reference = splitters
    cleaned = [Cleaner().normalize(text) for text in sample]
    assert [fast.split(text) for text in cleaned] == [reference.split(text) for text in cleaned]
    # the fast path itself, not its fallback, made nearly all of them
    assert sum(fast._fast.crosses(text) for text in cleaned) < len(cleaned) / 100


def test_fast_splitter_gives_the_sentencizer_sentences_on_the_tests_corpora(splitters):
    fast, reference = splitters
    rng = random.Random(0)
    documents = [unique_document(rng, words) for words in (60, 200) for _ in range(30)]
    documents += [near_copy(text) for text in documents[30:]]
    documents += [
        "Mr. Darcy   walked in.\tShe said „hello“ - and left! Did he notice? No.",
        "Write to jane@example.org or see https://example.com/austen?id=3 for more text here.",
        "Ünïcödé ﬁne ligatures and full-width ＡＢＣ survive NFKC. Short. Sentences are joined.",
        "Broken \ufffd\ufffd bytes in this line of text here.",
        # format characters that cleaning keeps (ZWNJ, ZWJ, RLM) and one it removes (ZWSP)
        "Persian \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645. A family "
        "\U0001f468\u200d\U0001f469\u200d\U0001f467! Hebrew \u05e9\u05dc\u05d5\u05dd\u200f. "
        "(shalom) As\u200bsociation.",
        " ".join(unique_document(rng, words=30) for _ in range(1000)),  # cut in CHUNK_CHARS
    ]
    assert len(documents[-1]) > 2 * CHUNK_CHARS
    for text in documents:
        for version in (text, Cleaner().normalize(text)):
            assert fast.split(version) == reference.split(version), version[:200]


def test_fast_splitter_on_random_punctuation_and_special_cases(splitters):
    fast, reference = splitters
    rng = random.Random(1)
    for _ in range(3000):
        text = " ".join("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 4)))
                        for _ in range(rng.randint(1, 30)))
        text = " ".join(text.split()) if rng.random() < 0.9 else text  # some irregular spaces
        assert fast.split(text) == reference.split(text), text
    # a special case's pattern across a space (' ') keeps spaCy from applying another ('s):
    # the pieces' own tokens would give other sentences, so the reference path is taken
    text = "ok. ' 's:) x"
    assert fast._fast.split(text) != [s.text.strip() for s in reference.nlp(text).sents]
    assert fast._fast.crosses(text) and fast.split(text) == reference.split(text)


def test_gated_moses_gives_sacremoses_text(sample):
    gated, library = Cleaner(), Cleaner(moses="sacremoses")
    assert isinstance(gated.moses, GatedMoses)
    assert [gated.normalize(t) for t in sample] == [library.normalize(t) for t in sample]
    lower = Cleaner(lowercase=True), Cleaner(lowercase=True, moses="sacremoses")
    assert lower[0].normalize(sample[5]) == lower[1].normalize(sample[5])
    rng = random.Random(2)
    moses = MosesPunctNormalizer(lang="en")
    for _ in range(5000):
        text = "".join(rng.choice(MOSES_PIECES) for _ in range(rng.randint(0, 40)))
        assert gated.moses.normalize(text) == moses.normalize(text), repr(text)
        assert gated.normalize(text) == library.normalize(text), repr(text)


def test_unknown_paths_are_refused():
    with pytest.raises(ValueError, match="sentence splitter"):
        SentenceSplitter(splitter="regex")
    with pytest.raises(ValueError, match="Moses normalizer"):
        Cleaner(moses="perl")
    with pytest.raises(ValueError, match="only the normalizer's default steps"):
        GatedMoses(MosesPunctNormalizer(lang="en", pre_replace_unicode_punct=True))
