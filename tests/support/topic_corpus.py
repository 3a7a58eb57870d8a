"""A corpus a tiny model learns from in a few dozen steps (test_demo_learns.py, test_hf_export.py):
each document draws its words from one of TOPICS topics of WORDS_PER_TOPIC made-up words, so a
masked word follows from the other words of its document (at best 1 / WORDS_PER_TOPIC right).
On the bundled novels a tiny model needs about 2,500 steps to get past word frequencies (bench/
README.md, "make demo")."""

import random

TOPICS, WORDS_PER_TOPIC, DOCUMENTS = 16, 4, 2000


def topic_words(rng: random.Random) -> list:
    """TOPICS lists of WORDS_PER_TOPIC made-up words, the first of `rng`'s draws."""
    words = set()
    while len(words) < TOPICS * WORDS_PER_TOPIC:  # consonant-vowel-consonant: one token each
        words.add(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") + rng.choice("bdfgklmnprstvz"))
    words = sorted(words)
    return [words[i::TOPICS] for i in range(TOPICS)]


def topic_documents(count: int, seed: int = 0) -> list:
    """`count` documents of 16 to 28 words, each drawn with repeats from one topic's words
    (topic_words(random.Random(seed)))."""
    rng = random.Random(seed)
    topics = topic_words(rng)
    return [" ".join(rng.choices(rng.choice(topics), k=rng.randint(16, 28))) for _ in range(count)]
