"""Stage 1, cleaning: NFKC, Moses punctuation normalisation, control characters, URLs, e-mails.

Moses' normalizer calls re.sub for each of its ~30 rules on every text (each call looks the
pattern up in re's cache). The default path (`moses="gated"`) applies the same rules in the same
order, compiled once, and skips a rule when a text lacks a substring every match of it holds
(`GatedMoses`): the same text out (tests/test_sentences.py), about a third of the cleaning time.
`moses="sacremoses"` calls the library's own normalize().
"""

import re
import unicodedata

from sacremoses import MosesPunctNormalizer

URL_TOKEN = "[URL]"
EMAIL_TOKEN = "[EMAIL]"

EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
URL = re.compile(r"\b(?:https?://|ftp://|www\.)[^\s<>\"']+[^\s<>\"'.,;:!?)\]}]", re.IGNORECASE)
# Cc (NUL, escapes, ...) and Cf/Cs/Co (format, surrogates, private use) go; whitespace stays.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                     r"\ufeff\ud800-\udfff\ue000-\uf8ff]")
WHITESPACE = re.compile(r"\s+")


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
        text = unicodedata.normalize("NFKC", text)
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
