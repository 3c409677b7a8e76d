"""Keys that only look like verl's: invisible characters or letters of another script in a key that prints as
a real one.

``data.train_batch_size`` followed by U+200B, or with a Cyrillic ``і`` (U+0456) for the Latin ``i``, prints
exactly like verl's key; Hydra takes it as a new key and the run keeps verl's value. A key is reduced to what a
reader sees: compatibility forms folded (NFKC: fullwidth letters, ligatures), every format character (Unicode
category Cf: zero-width spaces and joiners, bidirectional marks, the byte order mark, the soft hyphen, tag
characters), every other invisible character and every combining mark dropped, and the letters of Cyrillic,
Greek and Armenian that are drawn like Latin ones replaced by those. When that reduction is a real key that the
key as written is not, the key is a look-alike.
"""

from __future__ import annotations

import unicodedata

_INVISIBLE = frozenset(
    (0x034F, 0x115F, 0x1160, 0x180B, 0x180C, 0x180D, 0x180F, 0x3164, 0xFFA0, *range(0xFE00, 0xFE10))
) | frozenset(range(0xE0100, 0xE01F0))
"""Characters outside Cf that draw nothing: the combining grapheme joiner, Hangul fillers, variation selectors."""
_LATIN_LOOKALIKES = str.maketrans(
    "аеорсухіјѕԁԛԝһӏАВЕКМНОРСТХІЈЅ"  # Cyrillic
    "αινορυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ"  # Greek
    "օսհոց",  # Armenian
    "aeopcyxijsdqwhlABEKMHOPCTXIJS"  # the Latin letters they are drawn like
    "aivopuxABEZHIKMNOPTYX"
    "ouhng",
)
"""Letters drawn like a Latin letter (from Unicode's confusables for the three scripts), mapped to it."""


def hidden(char: str) -> bool:
    """A character that shows nothing: a format character (Cf), a combining mark, or another invisible one."""
    return unicodedata.category(char) in ("Cf", "Mn", "Me") or ord(char) in _INVISIBLE


def seen(key: str) -> str:
    """``key`` as a reader sees it (see the module's docstring)."""
    folded = unicodedata.normalize("NFKC", key)
    return "".join(c for c in folded if not hidden(c)).translate(_LATIN_LOOKALIKES)


def code_points(key: str) -> list[str]:
    """The characters of ``key`` that are not plain ASCII, as ``U+200B ZERO WIDTH SPACE``."""
    return [f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in dict.fromkeys(key) if ord(c) > 0x7E]


def lookalike(key: str) -> str | None:
    """The key ``key`` is drawn like when it holds characters that hide or pretend, else None."""
    if key.isascii():
        return None
    target = seen(key)
    return target if target != key and target.isascii() else None


__all__ = ["code_points", "hidden", "lookalike", "seen"]
