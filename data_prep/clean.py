"""Stage 1, cleaning: invisible format characters, NFKC, Moses punctuation normalisation, control
characters, URLs, e-mails.

Format characters (Unicode category Cf: zero-width space, soft hyphen, word joiner, BOM, bidi
marks, ...) are invisible: each one is removed, nothing put in its place, so that a word holding
one stays whole, except where the text needs it (`remove_format`). The exact key and the shingles
of de-duplication ignore every one of them (`without_format`).

Moses' normalizer calls re.sub for each of its ~30 rules on every text (each call looks the
pattern up in re's cache). The default path (`moses="gated"`) applies the same rules in the same
order, compiled once, and skips a rule when a text lacks a substring every match of it holds
(`GatedMoses`): the same text out (tests/test_sentences.py), about a third of the cleaning time.
`moses="sacremoses"` calls the library's own normalize().
"""

import re
import sys
import unicodedata

from sacremoses import MosesPunctNormalizer

URL_TOKEN = "[URL]"
EMAIL_TOKEN = "[EMAIL]"

EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
URL = re.compile(r"\b(?:https?://|ftp://|www\.)[^\s<>\"']+[^\s<>\"'.,;:!?)\]}]", re.IGNORECASE)
# Cc (NUL, escapes, ...), line and paragraph separators, Cs/Co (surrogates, private use) become
# spaces; whitespace stays.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ue000-\uf8ff]")
WHITESPACE = re.compile(r"\s+")


def _char_class(member) -> re.Pattern:
    """A character class of every code point for which member(character) holds, written as
    ranges of consecutive ones (re tests a character against each range in turn)."""
    ranges = []
    for point in range(sys.maxunicode + 1):
        if member(chr(point)):
            if ranges and ranges[-1][1] == point - 1:
                ranges[-1][1] = point
            else:
                ranges.append([point, point])
    return re.compile("[" + "".join(f"{re.escape(chr(first))}-{re.escape(chr(last))}"
                                    for first, last in ranges) + "]")


# Cf characters that are visible, not invisible: Unicode's Prepended_Concatenation_Mark (the
# Arabic number and year signs, the end of ayah, ...), which unicodedata does not list
VISIBLE_FORMAT = frozenset("\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891"
                           "\u08e2\U000110bd\U000110cd")
FORMAT = _char_class(lambda char: unicodedata.category(char) == "Cf"
                     and char not in VISIBLE_FORMAT)
ZWNJ, ZWJ = "\u200c", "\u200d"  # Unicode's Join_Control
# Unicode's Bidi_Control: ALM, LRM, RLM, embeddings and overrides, isolates
BIDI_CONTROL = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
RIGHT_TO_LEFT = ("R", "AL")  # bidi classes
EMOJI_PRESENTATION = "\ufe0f"  # the variation selector that ends many emoji before a ZWJ
BLACK_FLAG = "\U0001f3f4"  # with tag characters after it: a subdivision's flag (England)
TAGS = "".join(map(chr, range(0xE0020, 0xE0080)))


def without_format(text: str) -> str:
    """The text without any format character (Cf): what the exact key and the shingles are
    computed from, so that copies differing only in invisible characters are duplicates."""
    return text if text.isascii() else FORMAT.sub("", text)


def joins(before: str, joiner: str, after: str) -> bool:
    """Whether a script needs the ZWNJ or ZWJ between these two characters: letters or marks (L,
    M) of which one is right-to-left (Arabic, Persian, Syriac, ...: the joined or unjoined form)
    or a virama (combining class 9; Indic and other Brahmic scripts: a conjunct, half or
    ligature form), or a ZWJ in an emoji sequence: a symbol (So) after it, a symbol, a skin tone
    (Sk) or the emoji variation selector before it."""
    if unicodedata.category(before)[0] in "LM" and unicodedata.category(after)[0] in "LM":
        return any(unicodedata.bidirectional(char) in RIGHT_TO_LEFT
                   or unicodedata.combining(char) == 9 for char in (before, after))
    return (joiner == ZWJ and unicodedata.category(after) == "So"
            and (unicodedata.category(before) in ("So", "Sk") or before == EMOJI_PRESENTATION))


def holds_right_to_left_letter(text: str) -> bool:
    return any(unicodedata.category(char)[0] == "L" and unicodedata.bidirectional(char)
               in RIGHT_TO_LEFT for char in set(text))


def remove_format(text: str) -> str:
    """The text without its format characters (Cf), nothing put in their place, but for those
    it needs: ZWNJ and ZWJ where `joins` says so, the tags of an emoji tag sequence, and the
    bidi controls (BIDI_CONTROL) in bidi text, here a text that holds a right-to-left letter
    (bidi class R or AL). A text without any
    costs one scan (none when it is ASCII); only the format characters found are looked at."""
    found = () if text.isascii() else set(FORMAT.findall(text))
    if not found:
        return text
    bidi_text = not BIDI_CONTROL.isdisjoint(found) and holds_right_to_left_letter(text)

    def kept(match: re.Match) -> str:
        char, at = match.group(), match.start()
        if char in BIDI_CONTROL:
            return char if bidi_text else ""
        if char in (ZWNJ, ZWJ) and 0 < at < len(text) - 1:
            return char if joins(text[at - 1], char, text[at + 1]) else ""
        if char in TAGS:  # an emoji tag sequence's: the flag, then tags to a cancel tag
            return char if text[:at].rstrip(TAGS).endswith(BLACK_FLAG) else ""
        return ""

    return FORMAT.sub(kept, text)


# A substring that every match of a rule's pattern holds, for the patterns with regular
# expression syntax in sacremoses' rules; a literal pattern is its own. " +" -> " " changes a
# text only where two spaces meet.
NEEDS = {r"\r": "\r", r"\(": "(", r"\)": ")", r" +": "  ", r"\) ([.!:?;,])": ") ",
         r"\( ": "( ", r" \)": " )", r"(\d) %": " %", "([a-zA-Z])‘([a-zA-Z])": "‘",
         "([a-zA-Z])’([a-zA-Z])": "’", "\u00A0\\?": "\u00a0?", "\u00A0\\!": "\u00a0!",
         r'"([,.]+)': '"', "(\\d)\u00A0(\\d)": "\u00a0", r',"': ',"',
         r'(\.+)"(\s*[^<])': '."'}
SYNTAX = set(".^$*+?{}[]\\|()")
MOSES = ("gated", "sacremoses")


class GatedMoses:
    """normalize(text): MosesPunctNormalizer(...).normalize(text), its rules compiled once and
    each skipped when the text lacks the substring that any of its matches holds (NEEDS); a
    rule with syntax NEEDS does not know is always applied."""

    def __init__(self, moses: MosesPunctNormalizer):
        if moses.pre_replace_unicode_punct or moses.post_remove_control_chars:
            raise ValueError("GatedMoses: only the normalizer's default steps are gated")
        self.rules = []
        for pattern, substitution in moses.substitutions:
            need = pattern if not SYNTAX & set(pattern) else NEEDS.get(pattern, "")
            self.rules.append((need, re.compile(pattern).sub, substitution))

    def normalize(self, text: str) -> str:
        for need, sub, substitution in self.rules:
            if need in text:  # "" is in every text
                text = sub(substitution, text)
        return text.strip()


class Cleaner:
    """normalize(text) -> the cleaned text, or "" when nothing is left.

    moses: "gated" (default, GatedMoses) or "sacremoses" (the library's normalize, the
    reference); both give the same text."""

    def __init__(self, lowercase: bool = False, lang: str = "en", moses: str = "gated"):
        if moses not in MOSES:
            raise ValueError(f"Moses normalizer: choose {' or '.join(MOSES)}, not {moses!r}")
        self.lowercase = lowercase
        self.moses = MosesPunctNormalizer(lang=lang)
        if moses == "gated":
            self.moses = GatedMoses(self.moses)

    def normalize(self, text: str) -> str:
        text = unicodedata.normalize("NFKC", remove_format(text))
        text = CONTROL.sub(" ", text)
        if "@" in text:  # the cheap test spares most documents the regular expression
            text = EMAIL.sub(EMAIL_TOKEN, text)  # before URLs: an address is no URL
        if "://" in text or "www." in text.lower():
            text = URL.sub(URL_TOKEN, text)
        text = WHITESPACE.sub(" ", text)
        text = self.moses.normalize(text)
        if self.lowercase:
            text = text.lower().replace(URL_TOKEN.lower(), URL_TOKEN)
            text = text.replace(EMAIL_TOKEN.lower(), EMAIL_TOKEN)
        return WHITESPACE.sub(" ", text).strip()
