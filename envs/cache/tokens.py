"""The one token estimate for text whose token count nobody recorded: ``ceil(chars / 4)``.

Used wherever a count is missing and must be filled: the importers (sources that record no tokens),
data collect and the gateway (a reply without ``usage``). Four characters a token is the usual rule
of thumb for English with the GPT-style BPE tokenizers; it is an estimate, marked as such where it is
stored (``estimated`` in the call log and the journal). The worst-case *reservation* of a call before
it is sent is another rule (:func:`ccpo_jax.llm.calls.reserve_tokens`: it over-estimates on purpose).
"""
from __future__ import annotations

import math

#: Characters per token assumed by the estimate.
CHARS_PER_TOKEN = 4


def tokens_for_chars(n_chars: int) -> int:
    """Estimated tokens of ``n_chars`` characters of text: ``ceil(n_chars / CHARS_PER_TOKEN)``."""
    return math.ceil(n_chars / CHARS_PER_TOKEN)


def estimate_tokens(text: str) -> int:
    """Estimated tokens of ``text``: ``ceil(len(text) / CHARS_PER_TOKEN)``."""
    return tokens_for_chars(len(text))
