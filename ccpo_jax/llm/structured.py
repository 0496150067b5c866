"""The ``json`` round protocol: the CCPO base-guide round with structured replies that small models follow.

Why (measured, docs/real-llms.md): real small instruction-tuned models do not follow the paper's
free-text format (``Answer: ...`` after a chain of thought; ``Yes`` / ``No [answer]``): with
SmolLM2-135M-Instruct most base answers had no ``Answer:`` line and most verdicts did not start with
Yes or No, so the log-prob measures came back on few rounds. Here each reply is a JSON object whose
shape the server enforces (``response_format`` with a JSON schema; llama.cpp's server turns it into
a grammar, OpenAI and vLLM accept the same field):

* base: ``{"answer": "<answer>"}`` (no chain of thought: small models gain nothing from one and it
  costs most of a call);
* guide: ``{"verdict": "yes" | "no", "answer": "<the correct answer>"}``; on ``yes`` the round's
  guide answer is the base's (the paper's rule), on ``no`` the ``answer`` field.

A multiple-choice question (its text lists two or more options on lines of their own, ``A. ...``,
``B) ...``, :func:`option_labels`) gets the answer constrained to the option labels (an ``enum`` in the
schema), so a reply is always one of them. The rule reads the question text only, so ``data collect``,
the gateway and ``live-eval`` constrain the same questions the same way.

Reading a reply (:func:`read_json_answer`, :func:`read_json_verdict`) never guesses: the JSON object
(code fences or text around it allowed), else the *complete members* of an object the reply starts but
does not close (:func:`complete_members`: a reply cut at ``max_tokens``, or one whose grammar let text
follow an unclosed value), else the paper's free-text parsers (:mod:`ccpo_jax.llm.paper`) for a
server that ignored the schema, else unreadable. A member is complete when its value was written to
the end (a string's closing quote; another value followed by ``,`` or ``}``): a verdict written in full
before the reply was cut is read, an answer cut mid-value is not. Measured on the real cache
(docs/real-llms.md): 70 guide replies cut after a complete verdict, inside a runaway ``answer``.

Measures (the paper protocol's, on the value inside the JSON): base ``confidence`` = exp(mean
logprob) of the tokens that overlap the ``answer`` value's characters; guide ``uncertainty`` =
1 - p of the first token overlapping the ``verdict`` value (the ``yes`` / ``no``).
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

#: The base's first-round prompt.
BASE_PROMPT = (
    "Answer the question. Reply with a JSON object {{\"answer\": \"...\"}} holding only the final answer "
    "(a few words, a number, or the letter of the chosen option).\n\n"
    "Question: {question}"
)
#: The base's prompt after a guide reply (round 2 on): its earlier answers are in its chat.
BASE_RETRY = (
    "A reviewer checked your answer and replied: {guide_reply}\n"
    "Answer the question again. Reply with a JSON object {{\"answer\": \"...\"}}."
)
#: The guide's prompt: the paper's appendix 8.1 content (judge, correct if wrong) as a JSON reply.
GUIDE_PROMPT = (
    "Evaluate the answer.\n"
    "Q: {question}\n"
    "A: {answer}\n"
    "Reply with a JSON object: {{\"verdict\": \"yes\"}} if the answer is correct, or "
    "{{\"verdict\": \"no\", \"answer\": \"...\"}} with the correct answer if it is not."
)
PROMPTS = {"base": BASE_PROMPT, "base_retry": BASE_RETRY, "guide": GUIDE_PROMPT}
#: Longest free answer the schema allows (characters): an answer, not an essay.
MAX_ANSWER_CHARS = 64

_OPTION_LINE = re.compile(r"^[ \t]*\(?([A-Z])[.)][ \t]+\S", re.M)


def option_labels(question: str) -> tuple[str, ...] | None:
    """The option labels of a multiple-choice question, or None: two or more lines of the question
    that start ``A.`` / ``A)`` / ``(A)`` followed by text, with consecutive letters from ``A``."""
    found: list[str] = []
    for m in _OPTION_LINE.finditer(question):
        if m.group(1) not in found:
            found.append(m.group(1))
    if len(found) < 2 or found != [chr(ord("A") + i) for i in range(len(found))]:
        return None
    return tuple(found)


def _answer_schema(labels: tuple[str, ...] | None) -> dict[str, Any]:
    if labels:
        return {"type": "string", "enum": list(labels)}
    return {"type": "string", "minLength": 1, "maxLength": MAX_ANSWER_CHARS}


def base_schema(question: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"answer": _answer_schema(option_labels(question))},
            "required": ["answer"], "additionalProperties": False}


def guide_schema(question: str) -> dict[str, Any]:
    """``verdict`` first (its token is the uncertainty measure), then the correction. OpenAI's strict
    mode wants every property required: ``answer`` is required, and on ``yes`` it is not read."""
    return {"type": "object",
            "properties": {"verdict": {"type": "string", "enum": ["yes", "no"]},
                           "answer": _answer_schema(option_labels(question))},
            "required": ["verdict", "answer"], "additionalProperties": False}


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The request's ``response_format`` (OpenAI's shape; llama.cpp's server and vLLM read it too)."""
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


# -- reading ------------------------------------------------------------------------------------


def find_object(text: str) -> dict | None:
    """The JSON object a reply holds: the whole text, else the span from its first ``{`` to its last
    ``}`` (code fences or words around it); None when there is none."""
    s = text.strip()
    for cand in (s, s[s.find("{"): s.rfind("}") + 1] if "{" in s and "}" in s else ""):
        if not cand:
            continue
        try:
            obj = json.loads(cand)
        except (json.JSONDecodeError, ValueError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def complete_members(text: str) -> dict:
    """The members of the JSON object that ``text`` starts (after whitespace or a code fence) whose
    values were written to the end, in order, stopping at the first member that was not (the reply
    was cut there) or at anything that is not JSON; ``{}`` when the text starts no object.

    ``'{"verdict": "yes", "answer": "10000'`` gives ``{"verdict": "yes"}``; ``'{"answer": 12'`` gives
    ``{}`` (the number may have gone on); a closed object gives all its members (duplicates: the last).
    """
    s = text.lstrip()
    if s.startswith("```"):
        s = s[s.find("\n") + 1:] if "\n" in s else ""
    s = s.lstrip()
    if not s.startswith("{"):
        return {}
    out: dict[str, Any] = {}
    i = _WS.match(s, 1).end()
    while i < len(s) and s[i] == '"':
        try:
            key, i = _DECODER.raw_decode(s, i)
            i = _WS.match(s, i).end()
            if s[i:i + 1] != ":":
                break
            value, j = _DECODER.raw_decode(s, _WS.match(s, i + 1).end())
        except (json.JSONDecodeError, ValueError):
            break
        k = _WS.match(s, j).end()
        closed = k < len(s) and s[k] in ",}"
        if not (closed or isinstance(value, str)):
            break  # a number or a literal at the cut: it may have gone on
        out[key] = value
        if not closed or s[k] == "}":
            break
        i = _WS.match(s, k + 1).end()
    return out


def value_span(text: str, key: str) -> tuple[int, int] | None:
    """Character span of the string value of ``key`` in the reply text (inside the quotes), or None
    (absent, not a string, or written with escapes that make the raw and decoded values differ)."""
    m = re.search(r'"%s"\s*:\s*"((?:[^"\\]|\\.)*)"' % re.escape(key), text)
    if not m or "\\" in m.group(1):
        return None
    s, e = m.span(1)
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return (s, e) if e > s else None


def to_label(answer: str, labels: Sequence[str] | None) -> str:
    """A multiple-choice answer as its option label when it names one (``B``, ``b``, ``(B)``, ``B.``,
    ``B. 4``); else the answer as given."""
    a = answer.strip()
    if labels:
        m = re.match(r"^\(?([A-Za-z])(?:[.):\s]|$)", a)
        if m and m.group(1).upper() in labels:
            return m.group(1).upper()
    return a


def read_json_answer(text: str, labels: Sequence[str] | None) -> tuple[str, tuple[int, int] | None] | None:
    """(answer, its span in ``text`` for the confidence, None when not measurable) from a base reply
    in the JSON shape; None when the reply holds no such object or its answer is empty."""
    obj = find_object(text) or complete_members(text)
    if not isinstance(obj.get("answer"), (str, int, float)) or isinstance(obj.get("answer"), bool):
        return None
    ans = to_label(str(obj["answer"]), labels)
    if not ans:
        return None
    return ans, value_span(text, "answer")


def read_json_verdict(text: str, labels: Sequence[str] | None) -> tuple[bool, str | None, tuple[int, int] | None] | None:
    """(verdict, correction or None, span of the verdict value) from a guide reply in the JSON shape;
    None when there is no object or its verdict is not yes/no (true/false also read). A cut reply's
    complete members are read (:func:`complete_members`): a cut ``answer`` is no correction."""
    obj = find_object(text) or complete_members(text)
    v = obj.get("verdict")
    if isinstance(v, bool):
        verdict = v
    elif isinstance(v, str) and v.strip().lower() in ("yes", "no"):
        verdict = v.strip().lower() == "yes"
    else:
        return None
    corr = obj.get("answer")
    corr = to_label(str(corr), labels) if isinstance(corr, (str, int, float)) and not isinstance(corr, bool) else ""
    return verdict, (corr or None), value_span(text, "verdict")
