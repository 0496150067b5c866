"""The round protocols, by name: what ``data collect``, the gateway and ``live-eval`` send and read.

* ``json`` (the default): structured replies that small real models follow
  (:mod:`ccpo_jax.llm.structured`: a JSON schema in ``response_format``, answers of
  multiple-choice questions constrained to the option labels, no chain of thought);
* ``paper``: the CCPO paper's free-text protocol (arXiv 2511.11828, appendix 8.1;
  :mod:`ccpo_jax.llm.paper`): chain of thought ending ``Answer: ...``, ``Yes`` / ``No [answer]``.

One protocol per cache: ``data collect --round-protocol`` records it in the manifest
(``provenance.round_protocol``), ``export`` carries the cache's provenance into the artefact, and the
gateway and ``live-eval`` run the artefact's protocol (:func:`of_provenance`), so a router is served
with the protocol its training data was collected with. A cache without the field (collected before
it existed, imported, synthetic) is read as ``paper``: that is the protocol those caches describe.
The baselines' prompts (LLM-EXIT, LLM-as-policy) are the paper's under both.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

from ccpo_jax.errors import UserError
from ccpo_jax.llm import paper as P
from ccpo_jax.llm import structured as S

NAMES = ("json", "paper")
DEFAULT = "json"
#: The manifest field (under ``provenance``) that names a cache's round protocol.
FIELD = "round_protocol"


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One round protocol: messages, ``response_format`` and the reading of each reply.
    ``base_max_tokens`` / ``guide_max_tokens``: the defaults of ``--base-max-tokens`` / ``--guide-max-tokens``."""

    name: str
    base_max_tokens: int
    guide_max_tokens: int

    @property
    def structured(self) -> bool:
        return self.name == "json"

    def prompts(self) -> dict[str, str]:
        return {**P.PROMPTS, **S.PROMPTS} if self.structured else dict(P.PROMPTS)

    def prompt_hashes(self) -> dict[str, str]:
        """sha256 (hex, first 16) of each template, for the provenance (the paper's are :func:`P.prompt_hashes`)."""
        return {k: hashlib.sha256(v.encode("utf-8")).hexdigest()[:16] for k, v in self.prompts().items()}

    def base_messages(self, question: str, history: Sequence[tuple[str, str]]) -> list[dict]:
        if not self.structured:
            return P.base_messages(question, history)
        msgs = [{"role": "user", "content": S.BASE_PROMPT.format(question=question)}]
        for completion, feedback in history:
            msgs.append({"role": "assistant", "content": completion})
            msgs.append({"role": "user", "content": S.BASE_RETRY.format(guide_reply=feedback.strip())})
        return msgs

    def guide_messages(self, question: str, shown: str) -> list[dict]:
        if not self.structured:
            return P.guide_messages(question, shown)
        return [{"role": "user", "content": S.GUIDE_PROMPT.format(question=question, answer=shown)}]

    def guide_prompt_chars(self) -> int:
        """Characters of the guide template (the cost bounds add the question's and the answer's)."""
        return len(S.GUIDE_PROMPT if self.structured else P.GUIDE_PROMPT)

    def base_format(self, question: str) -> dict[str, Any] | None:
        """The base request's ``response_format`` (None: none sent)."""
        return S.response_format("ccpo_base", S.base_schema(question)) if self.structured else None

    def guide_format(self, question: str) -> dict[str, Any] | None:
        return S.response_format("ccpo_guide", S.guide_schema(question)) if self.structured else None

    def read_base(self, question: str, text: str, logprobs: Sequence[tuple[str, float]] | None) -> P.BaseRead:
        """The base reply read: the JSON answer, else the paper's ``Answer:`` line (a server that ignored
        the schema), else unparsed (the guide is then shown the whole reply)."""
        if not self.structured:
            return P.read_base(text, logprobs)
        got = S.read_json_answer(text, S.option_labels(question))
        if got is None:
            return P.read_base(text, logprobs)
        ans, span = got
        return P.BaseRead(ans, True, P.answer_confidence(logprobs, text, span), ans)

    def read_guide(self, question: str, text: str, logprobs: Sequence[tuple[str, float]] | None,
                   base_answer: str) -> P.GuideRead:
        """The guide reply read: the JSON verdict, else the paper's ``Yes`` / ``No [answer]``, else unreadable."""
        if not self.structured:
            return P.read_guide(text, logprobs, base_answer)
        got = S.read_json_verdict(text, S.option_labels(question))
        if got is None:
            return P.read_guide(text, logprobs, base_answer)
        verdict, corr, span = got
        ans = base_answer if verdict else (corr or "")
        return P.GuideRead(verdict, None if verdict else corr, ans, span_uncertainty(logprobs, text, span))


def span_uncertainty(logprobs: Sequence[tuple[str, float]] | None, text: str,
                     span: tuple[int, int] | None) -> float | None:
    """1 - p of the first token that overlaps ``text[span]`` and holds a letter or digit (the verdict's
    ``yes`` / ``no``); None when not measurable (no log-probs, no span, tokens that do not spell ``text``:
    :func:`~ccpo_jax.llm.paper.token_offset`)."""
    at = P.token_offset(logprobs, text)
    if at is None or span is None:
        return None
    s, e = span[0] + at, span[1] + at
    spelled = "".join(t for t, _ in logprobs)
    pos = 0
    for tok, lp in logprobs:
        end = pos + len(tok)
        if end > s and pos < e and any(ch.isalnum() for ch in spelled[max(pos, s): min(end, e)]):
            return round(min(1.0, max(0.0, 1.0 - math.exp(lp))), 6)
        pos = end
    return None


PROTOCOLS = {
    "json": Protocol("json", base_max_tokens=48, guide_max_tokens=48),
    "paper": Protocol("paper", base_max_tokens=512, guide_max_tokens=32),
}


def get(name: str, flag: str = "--round-protocol") -> Protocol:
    """The protocol named ``name``; a UserError naming ``flag`` otherwise."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise UserError(f"{flag} {name!r}: one of {', '.join(NAMES)}") from None


def of_provenance(provenance: dict) -> Protocol:
    """The protocol a cache (or an artefact's cache) was collected with: ``provenance.round_protocol``,
    ``paper`` when absent (caches from before the field, importers, generators)."""
    name = provenance.get(FIELD, "paper")
    if name not in PROTOCOLS:
        raise UserError(f"provenance.{FIELD} {name!r}: not a protocol of this build ({', '.join(NAMES)})")
    return PROTOCOLS[name]
