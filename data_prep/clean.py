"""Stage 1, cleaning: NFKC, Moses punctuation normalisation, control characters, URLs, e-mails."""

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


class Cleaner:
    """normalize(text) -> the cleaned text, or "" when nothing is left."""

    def __init__(self, lowercase: bool = False, lang: str = "en"):
        self.lowercase = lowercase
        self.moses = MosesPunctNormalizer(lang=lang)

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
