"""Answer normalisation (docs/caches.md): the SQuAD-style rule that decides
when two answers are "the same answer" (same per-question id, one element of
the answer set C(Q), arXiv 2511.11828 Eq. 1).

Steps, in this order (the SQuAD v1.1 evaluation order):

1. Unicode NFC (so composed and decomposed accents compare equal);
2. lower case;
3. drop punctuation: ASCII punctuation (``string.punctuation``) and every
   Unicode punctuation character (categories ``P*``, e.g. curly quotes,
   dashes, ellipsis). Punctuation is deleted, not replaced by a space, as in
   SQuAD ("U.S.A." -> "usa", "well-known" -> "wellknown"). Control characters
   (category ``Cc``) become spaces;
4. drop the articles "a", "an", "the" as whole words, except an answer that is the letter "a" alone
   (after steps 1-3): that is option A of a multiple-choice question (``A``, ``(A)``, ``A.``), not an
   article, and stays ``a`` (without this exception a gold ``A`` normalised to the empty string);
5. collapse runs of whitespace to one space and strip the ends.

The manifest records this rule as ``normalisation = "lower-strip-punct-articles"``.
"""
from __future__ import annotations

import re
import string
import unicodedata

#: Name of the rule, stored in every manifest.
NORMALISATION = "lower-strip-punct-articles"

_ASCII_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


class _Table(dict):
    """str.translate table filled on demand: punctuation -> deleted, control -> space."""

    def __missing__(self, cp: int) -> str | None | int:
        ch = chr(cp)
        cat = unicodedata.category(ch)
        if cat.startswith("P") or ch in _ASCII_PUNCT:
            val: str | None | int = None
        elif cat == "Cc":
            val = " "
        else:
            val = cp  # unchanged
        self[cp] = val
        return val


_TABLE = _Table()


def normalise_answer(text: str) -> str:
    """The normalised form of an answer text (see the module docstring).

    >>> normalise_answer("  The Indiana University! ")
    'indiana university'
    """
    s = unicodedata.normalize("NFC", text).lower()
    s = s.translate(_TABLE)
    if s.strip() == "a":  # option A of a multiple-choice question (step 4's exception)
        return "a"
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())
