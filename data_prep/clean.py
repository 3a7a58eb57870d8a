"""Stage 1, cleaning: invisible characters, NFKC, Moses punctuation normalisation, control
characters, URLs, e-mails.

Invisible characters are Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt:
zero-width space, soft hyphen, word joiner, BOM, bidi marks, tags, variation selectors, Hangul
fillers, ...): each run of them is removed, nothing put in its place, so that a word holding one
stays whole, except for what the text needs (`remove_format`). The exact key and the shingles of
de-duplication ignore every one of them (`without_format`). Each step is linear in the text: a
page of tag characters (the "ASCII smuggling" pattern) or of dotted words before an "@" costs
what its length does (tests/test_clean_scripts.py).

Moses' normalizer calls re.sub for each of its ~30 rules on every text (each call looks the
pattern up in re's cache). The default path (`moses="gated"`) applies the same rules in the same
order, compiled once, and skips a rule when a text lacks a substring every match of it holds
(`GatedMoses`): the same text out (tests/test_sentences.py), about a third of the cleaning time.
`moses="sacremoses"` calls the library's own normalize().
"""

import functools
import re
import unicodedata

import regex
from sacremoses import MosesPunctNormalizer

URL_TOKEN = "[URL]"
EMAIL_TOKEN = "[EMAIL]"

# The local part starts at the first word boundary of its run of [\w.+-], the run's start found
# by the lookbehind and the boundary kept (atomic): one try a run, not one a boundary, which made
# "a.a.a. ... @" quadratic (80,000 dotted letters: 45 s).
EMAIL = re.compile(r"(?<![\w.+-])(?>([\w.+-]*?)\b)[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
URL = re.compile(r"\b(?:https?://|ftp://|www\.)[^\s<>\"']+[^\s<>\"'.,;:!?)\]}]", re.IGNORECASE)
# Cc (NUL, escapes, ...), line and paragraph separators, Cs/Co (surrogates, private use) become
# spaces; whitespace stays.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ue000-\uf8ff]")
WHITESPACE = re.compile(r"\s+")

# Unicode properties come from the regex package (a recent Unicode version; Python's unicodedata
# lags and has no Default_Ignorable_Code_Point). U+2800 BRAILLE PATTERN BLANK is not default
# ignorable, but looks like nothing inside a word and hides copies as well as they do; it is
# kept in Braille text (a text holding another Braille pattern), where it is the space.
INVISIBLE = regex.compile(r"[\p{Default_Ignorable_Code_Point}\u2800]+")
ZWNJ, ZWJ = "\u200c", "\u200d"  # Unicode's Join_Control
# The most joiners a run keeps: ZWJ ZWNJ ZWJ, a ligature broken with the letters still joined
# (Unicode Standard, section 23.2), is the longest sequence a script gives a meaning
MOST_JOINERS = 3
BRAILLE_BLANK = "\u2800"
BRAILLE = regex.compile(r"[\u2801-\u28ff]")
# What a run of invisible characters may keep: the joiners, the bidi controls, the variation
# selectors, the Braille blank and CGJ; the rest of it (tags but a flag's, SHY, ZWSP, ...) goes.
KEEPABLE = regex.compile(r"[\u200c\u200d\p{Bidi_Control}\p{Variation_Selector}\u2800\u034f]")
# COMBINING GRAPHEME JOINER between two combining marks keeps them in the order written, which
# canonical ordering (NFKC) would change (Unicode Standard, section 23.2: Hebrew, Arabic points)
CGJ = "\u034f"
MARK = regex.compile(r"\p{M}")
BIDI_CONTROL = regex.compile(r"\p{Bidi_Control}")  # ALM, LRM, RLM, embeddings, overrides, isolates
RIGHT_TO_LEFT_LETTER = regex.compile(r"(?V1)[[\p{Bidi_Class=R}\p{Bidi_Class=AL}]&&\p{L}]")
# A variation sequence: the emoji presentation selectors after an emoji (UTS #51, ED-8a and
# ED-9a), any selector after an ideograph (UTS #37's ideographic variation sequences and
# StandardizedVariants.txt), the free variation selectors after a Mongolian letter
# (StandardizedVariants.txt; Unicode Standard, section 13.5).
VARIATION_SEQUENCE = regex.compile(
    r"\p{Emoji}[\ufe0e\ufe0f]|\p{Ideographic}[\ufe00-\ufe0f\U000e0100-\U000e01ef]"
    r"|\p{Script=Mongolian}[\u180b-\u180d\u180f]")
# A subdivision flag: the black flag, a subdivision code in tags (3 to 7 lower-case letters and
# digits), the cancel tag (UTS #51, ED-14a and Annex C); any other tag goes.
BLACK_FLAG = "\U0001f3f4"
FLAG_TAGS = regex.compile(r"[\U000e0030-\U000e0039\U000e0061-\U000e007a]{3,7}\U000e007f")
# Where a joiner means something, matched backwards from the start of its run ((?r), BEFORE) or
# forwards from its end (AFTER), the run's other characters taken as absent:
# - next to a virama (canonical combining class 9), whatever is on the other side: after it, a
#   half form, an explicit virama or a chillu/khanda ta at a word's end (Unicode Standard,
#   sections 12.1, 12.2, 12.9; UAX #31, rules A2 and B, with their marks $M1 after the virama);
#   before it, the ra of Bengali <ra, ZWJ, virama, ya> and Sinhala's touching letters (sections
#   12.2, 13.2);
# - between joining letters (Joining_Type D, L, R or C, transparent marks between: Arabic,
#   Syriac, Mongolian, N'Ko, ...; section 9.2, ArabicShaping.txt, UAX #31 rule A1), and a ZWJ
#   beside one, which shows its joining form alone (section 9.2);
# - a ZWJ between pictographs in an emoji ZWJ sequence, the first one's modifiers, selector or
#   tags between (UAX #29, rule GB11; UTS #51, ED-16).
# No context reaches past another run's joiner (ZWNJ is Grapheme_Cluster_Break Extend but taken
# out of PICTOGRAPH_BEFORE), so that each character is read by one run on either side of it.
VIRAMA_BEFORE = regex.compile(r"(?rV1)\p{ccc=9}[\p{Mn}&&\P{ccc=0}]*")
VIRAMA_AFTER = regex.compile(r"\p{ccc=9}")
JOINING_BEFORE = regex.compile(r"(?r)[\p{jt=D}\p{jt=L}\p{jt=R}\p{jt=C}]\p{jt=T}*")
JOINING_AFTER = regex.compile(r"\p{jt=T}*[\p{jt=D}\p{jt=L}\p{jt=R}\p{jt=C}]")
PICTOGRAPH_BEFORE = regex.compile(r"(?rV1)\p{Extended_Pictographic}[\p{GCB=Extend}--\u200c]*")
PICTOGRAPH_AFTER = regex.compile(r"\p{Extended_Pictographic}")


def without_format(text: str) -> str:
    """The text without any invisible character (INVISIBLE): what the exact key and the
    shingles are computed from, so that copies differing only in invisible characters, kept
    ones too, are duplicates."""
    return text if text.isascii() else INVISIBLE.sub("", text)


def joins(text: str, start: int, end: int) -> tuple:
    """Which joiners, of ZWNJ and ZWJ, a script needs in place of text[start:end], a run of
    invisible characters, by the rules above (VIRAMA_BEFORE, ...) read in its neighbours."""
    joining_before = JOINING_BEFORE.match(text, 0, start)
    joining_after = JOINING_AFTER.match(text, end)
    if (VIRAMA_BEFORE.match(text, 0, start) or VIRAMA_AFTER.match(text, end)
            or joining_before and joining_after):
        return ZWNJ, ZWJ
    if (joining_before or joining_after
            or PICTOGRAPH_BEFORE.match(text, 0, start) and PICTOGRAPH_AFTER.match(text, end)):
        return (ZWJ,)
    return ()


def remove_format(text: str) -> str:
    """The text without its invisible characters (INVISIBLE), nothing put in their place, but
    for those it needs: in each run of them, the joiners where `joins` says so (a joiner
    repeated in a row kept once), the bidi controls in bidi text (a text that holds a
    right-to-left letter), a variation selector that makes a VARIATION_SEQUENCE with the
    character before, the tags of a subdivision's flag, the Braille blank in Braille text. One
    scan of the text (none when it is ASCII); a run costs its length and a look at its
    neighbours."""
    if text.isascii():
        return text
    # whether the text is bidi text, Braille text: asked once, when first needed
    holds = functools.cache(lambda pattern: pattern.search(text) is not None)

    def kept(run: regex.Match) -> str:
        start, end = run.span()
        out = []
        if text[start - 1:start] == BLACK_FLAG and (flag := FLAG_TAGS.match(text, start, end)):
            out.append(flag.group())
        needed = last_joiner = None
        joiners = 0
        for char in KEEPABLE.findall(text, start, end):
            if char in (ZWNJ, ZWJ):
                if needed is None:
                    needed = joins(text, start, end)
                keep = char in needed and char != last_joiner and joiners < MOST_JOINERS
                last_joiner, joiners = (char, joiners + 1) if keep else (last_joiner, joiners)
            elif BIDI_CONTROL.match(char):
                keep = holds(RIGHT_TO_LEFT_LETTER)
            elif char == BRAILLE_BLANK:
                keep = holds(BRAILLE)
            elif char == CGJ:
                keep = bool(MARK.fullmatch(text[start - 1:start]) and MARK.match(text, end))
            else:
                keep = not out and VARIATION_SEQUENCE.fullmatch(text[start - 1:start] + char)
            if keep:
                out.append(char)
        return "".join(out)

    return INVISIBLE.sub(kept, text)


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

    def __init__(self, lowercase: bool = False, moses: str = "gated"):
        if moses not in MOSES:
            raise ValueError(f"Moses normalizer: choose {' or '.join(MOSES)}, not {moses!r}")
        self.lowercase = lowercase
        self.moses = MosesPunctNormalizer(lang="en")
        if moses == "gated":
            self.moses = GatedMoses(self.moses)

    def normalize(self, text: str) -> str:
        # NFKC first: it makes joining letters of presentation forms (a joiner between them
        # means something only then), and it splits characters (U+203C into "!!") that a
        # variation selector kept after them would be left behind by; and nothing it composes
        # or reorders after a character is removed (CGJ, a Hangul filler)
        text = remove_format(unicodedata.normalize("NFKC", text))
        text = CONTROL.sub(" ", text)
        if "@" in text:  # the cheap test spares most documents the regular expression
            text = EMAIL.sub(r"\g<1>" + EMAIL_TOKEN, text)  # before URLs: an address is no URL
        if "://" in text or "www." in text.lower():
            text = URL.sub(URL_TOKEN, text)
        text = WHITESPACE.sub(" ", text)
        text = self.moses.normalize(text)
        if self.lowercase:
            text = text.lower().replace(URL_TOKEN.lower(), URL_TOKEN)
            text = text.replace(EMAIL_TOKEN.lower(), EMAIL_TOKEN)
        return WHITESPACE.sub(" ", text).strip()
