"""The CCPO base-guide round protocol (arXiv 2511.11828, orchestration protocol): prompts, parsers, measures.

One round t of a question:

1. the base model answers with chain-of-thought (:data:`BASE_PROMPT`; from
   round 2 on, its context holds its earlier rounds' completions and the
   guide's replies to them, :data:`BASE_RETRY`), ending with ``Answer: ...``;
2. the guide judges the base's (parsed) answer with the paper's guide prompt
   (appendix 8.1, :data:`GUIDE_PROMPT`, verbatim) and replies ``Yes`` or
   ``No [correct answer]``.

The paper's template shows the guide only ``{answer}`` (App. 8.1; the paper's
text also mentions the reasoning chain); the costs it reports fit the
short prompt, so the guide sees the parsed answer, or the whole completion
when no ``Answer:`` line can be found.

Baselines (arXiv 2511.11828 §5). The paper's appendix 8.2 / 8.3 prompts are known to
us only by a summary of what they contain, so :data:`EXIT_PROMPT` and
:data:`POLICY_PROMPT` are reconstructions with that content, and their hashes
are in every cache's provenance:

* LLM-EXIT of a model: it answers round after round (the base prompt, its own
  earlier completions in its context, no guide) and after each answer but the
  last is asked whether to stop: ``[EXIT]`` if the latest answer repeats an
  earlier one, there is no valid answer, or the latest answer is correct,
  else ``[CONTINUE]``;
* LLM-as-policy of a model: at each round of the collected base-guide chain it
  sees the question, both answers, the verdict and the guide's uncertainty,
  and replies 1 (base answer), 2 (guide answer) or 3 (next round), aiming at
  about ``1 - alpha`` coverage.

Parsers never guess: a reply that does not start with the expected token is
reported as unreadable (None), and the collector records it as such.

Measures from token log-probabilities (only when the endpoint returns them;
absent otherwise, never invented). UALA (Han et al. 2024) scores a single
inference by the probabilities of its tokens (min / avg / log-sum / norm /
entropy); we use two plain versions, without UALA's temperature scaling:

* guide ``uncertainty`` = 1 - p(verdict token), p = exp(logprob) of the first
  completion token that holds a letter or digit (the ``Yes`` / ``No``);
* base ``confidence`` = exp(mean logprob) over the tokens of the final answer
  span (the text after ``Answer:``), i.e. the geometric mean of their
  probabilities (UALA's "avg" measure on the answer).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Sequence

from envs.cache.normalise import normalise_answer

BASE_PROMPT = (
    "Answer the following question. Think step by step, then give your final answer on the last line "
    "in the form \"Answer: <answer>\", with only the answer (a few words) after \"Answer:\".\n\n"
    "Question: {question}"
)
BASE_RETRY = (
    "A reviewer checked your answer and replied: {guide_reply}\n"
    "Answer the question again. Think step by step, then give your final answer on the last line "
    "in the form \"Answer: <answer>\"."
)
#: Paper appendix 8.1, verbatim (line breaks as in the paper's layout).
GUIDE_PROMPT = (
    "Evaluate the answer.\n"
    "- If correct, reply \"Yes\".\n"
    "- If incorrect, reply \"No [correct answer]\" (only the correct answer, nothing else).\n"
    "Q: {question}\n"
    "A: {answer}\n"
    "Your response:"
)
#: LLM-EXIT's next-round prompt (no guide: the model reconsiders on its own).
EXIT_RETRY = (
    "Reconsider the question. Think step by step, then give your final answer on the last line "
    "in the form \"Answer: <answer>\"."
)
#: LLM-EXIT's stop decision (reconstruction of appendix 8.2 from its content).
EXIT_PROMPT = (
    "You are answering a question in rounds and must decide whether to stop.\n"
    "- Reply \"[EXIT]\" if the latest answer repeats an earlier answer, if there is no valid answer, "
    "or if the latest answer is correct.\n"
    "- Otherwise reply \"[CONTINUE]\".\n"
    "Reply with [EXIT] or [CONTINUE] only.\n"
    "Question: {question}\n"
    "Answers so far:\n{answers}\n"
    "Your response:"
)
#: LLM-as-policy (reconstruction of appendix 8.3 from its content).
POLICY_PROMPT = (
    "A small base model answers a question and a stronger guide model checks its answer, round by round. "
    "Choose what to do so that the chosen answer is correct for approximately {coverage} of questions, "
    "using as few rounds as possible (every round costs a guide call).\n"
    "- Reply \"1\" to take the base model's latest answer.\n"
    "- Reply \"2\" to take the guide model's latest answer.\n"
    "{next_line}"
    "Reply with the number only.\n"
    "Question: {question}\n"
    "{rounds}\n"
    "Your response:"
)
POLICY_NEXT = "- Reply \"3\" to run another round.\n"
POLICY_LAST = "- This is the last round: \"3\" (another round) is not available.\n"

PROMPTS = {
    "base": BASE_PROMPT,
    "base_retry": BASE_RETRY,
    "guide": GUIDE_PROMPT,
    "exit_retry": EXIT_RETRY,
    "exit": EXIT_PROMPT,
    "policy": POLICY_PROMPT + POLICY_NEXT + POLICY_LAST,
}


def prompt_hashes() -> dict[str, str]:
    """sha256 (hex, first 16) of each template, for the provenance."""
    return {k: hashlib.sha256(v.encode("utf-8")).hexdigest()[:16] for k, v in PROMPTS.items()}


# -- parsing ---------------------------------------------------------------------------------

# Leading decoration a model may put before its reply: whitespace, markdown, quotes, a label.
_LEAD = re.compile(r"^(?:[\s*_`\"'>#]|(?:your\s+)?(?:response|reply|answer|verdict)\s*:)+", re.I)
_ANSWER_LINE = re.compile(r"^[ \t*_#>]*(?:final\s+)?answer[ \t*_]*[:\uff1a][ \t]*(?P<a>.*?)[ \t]*$", re.I | re.M)
_ANSWER_ANY = re.compile(r"(?:final\s+)?answer(?:\s+is)?[ \t*_]*[:\uff1a][ \t]*(?P<a>[^\n]*?)[ \t]*$", re.I | re.M)
_TRIM = " \t*_`\"'“”‘’<>[]()."
# "the correct answer is X", "correct answer: X", "the answer is X", "it is X" -> X
# (a bare "answer 12" is kept whole: it may be the answer itself).
_CORR_PREFIX = re.compile(
    r"^(?:the\s+)?(?:correct|right)\s+answer(?:\s+is|\s+should\s+be)?\s*[:\-–—]?\s*"
    r"|^(?:the\s+)?answer(?:\s+is\s*:?|\s*:)\s*|^it(?:'s|\s+is)\s+",
    re.I,
)


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start] in _TRIM:
        start += 1
    while end > start and text[end - 1] in _TRIM:
        end -= 1
    return start, end


def parse_base_answer(text: str) -> tuple[str, tuple[int, int]] | None:
    """The final answer of a chain-of-thought completion and its character span, or None.

    The last line that starts ``Answer:`` (or ``Final answer:``; markdown allowed),
    else the last ``answer (is):`` anywhere on a line; markdown, quotes, brackets
    and a final period around the answer are dropped. None when there is none or
    it is empty.
    """
    for pat in (_ANSWER_LINE, _ANSWER_ANY):
        ms = [m for m in pat.finditer(text)]
        for m in reversed(ms):
            s, e = _strip_span(text, m.start("a"), m.end("a"))
            if e > s:
                return text[s:e], (s, e)
    return None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The guide's reply. ``correct``: True (Yes), False (No), None (unreadable);
    ``correction``: the corrected answer after ``No``, None when it gave none."""

    correct: bool | None
    correction: str | None


def parse_verdict(text: str) -> Verdict:
    """``Yes`` / ``No [answer]`` (the paper's format) and close variants; anything else is unreadable.

    Accepted: optional markdown/quotes or a ``Response:`` label, then the word
    yes or no (any case), then for No the correction: in brackets, or after
    ``,`` ``.`` ``:`` or ``-``, on the same line, with a leading "the correct
    answer is" dropped. ``No [correct answer]`` (the template's placeholder
    copied) counts as no correction. Not accepted (unreadable): "Correct",
    "Incorrect", "Nope", "I think so", an empty reply, ...
    """
    s = _LEAD.sub("", text)
    m = re.match(r"(yes|no)\b", s, re.I)
    if not m:
        return Verdict(None, None)
    if m.group(1).lower() == "yes":
        return Verdict(True, None)
    rest = s[m.end():]
    rest = rest.lstrip(" \t,.:;-–—*_")
    if rest.startswith("["):
        close = rest.find("]")
        corr = rest[1:close] if close > 0 else rest[1:].split("\n", 1)[0]
    else:
        corr = rest.split("\n", 1)[0]
    corr = _CORR_PREFIX.sub("", corr.strip()).strip(_TRIM)
    if not corr or normalise_answer(corr) in ("", "correct answer"):
        return Verdict(False, None)
    return Verdict(False, corr)


def parse_exit(text: str) -> bool | None:
    """LLM-EXIT decision: True = exit, False = continue, None = unreadable."""
    s = _LEAD.sub("", text)
    m = re.match(r"\[?\s*(exit|continue)\s*\]?", s, re.I)
    if not m:
        return None
    return m.group(1).lower() == "exit"


def parse_policy_action(text: str, last_round: bool) -> int | None:
    """LLM-as-policy reply -> cache action (0 base, 1 guide, 2 next), None = unreadable.

    The reply must start with 1, 2 or 3 (after decoration or an ``Action:`` label);
    3 in the last round is not an available action and reads as None.
    """
    s = re.sub(r"^\s*(?:action|choice)\s*:\s*", "", _LEAD.sub("", text), flags=re.I)
    m = re.match(r"\[?([123])(?![0-9.])", s)
    if not m:
        return None
    a = int(m.group(1)) - 1
    if a == 2 and last_round:
        return None
    return a


# -- correctness -----------------------------------------------------------------------------


def token_f1(pred: str, gold: str) -> float:
    """SQuAD token F1 of two answers after :func:`normalise_answer`."""
    p, g = normalise_answer(pred).split(), normalise_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common: dict[str, int] = {}
    for w in g:
        common[w] = common.get(w, 0) + 1
    same = 0
    for w in p:
        if common.get(w, 0) > 0:
            common[w] -= 1
            same += 1
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def is_correct(answer: str, golds: Sequence[str], f1_threshold: float | None = None) -> bool:
    """Normalised exact match against any gold alias, or token F1 >= ``f1_threshold`` when given.

    An empty answer (none given) is never correct.
    """
    a = normalise_answer(answer)
    if not a:
        return False
    if any(a == normalise_answer(g) for g in golds):
        return True
    if f1_threshold is not None:
        return any(token_f1(answer, g) >= f1_threshold for g in golds)
    return False


# -- measures from log-probs -----------------------------------------------------------------


def verdict_uncertainty(logprobs: Sequence[tuple[str, float]] | None) -> float | None:
    """1 - p of the first token holding a letter or digit (the verdict token); None without log-probs."""
    if not logprobs:
        return None
    for tok, lp in logprobs:
        if any(ch.isalnum() for ch in tok):
            return _unit(1.0 - math.exp(lp))
    return None


def token_offset(logprobs: Sequence[tuple[str, float]] | None, text: str) -> int | None:
    """Where ``text`` starts in the characters the tokens spell: 0 when they spell it exactly; the one
    place it occurs when the server trimmed what it returned as ``content`` (whitespace after it, a code
    fence around a JSON object: llama.cpp does both; measured on the real cache, docs/real-llms.md);
    None without log-probs, or when ``text`` is not in them exactly once (the measure is never guessed)."""
    if not logprobs or not text:
        return None
    spelled = "".join(t for t, _ in logprobs)
    if spelled == text:
        return 0
    at = spelled.find(text)
    return at if at >= 0 and spelled.find(text, at + 1) < 0 else None


def answer_confidence(logprobs: Sequence[tuple[str, float]] | None, text: str,
                      span: tuple[int, int] | None) -> float | None:
    """exp(mean logprob) of the tokens overlapping ``text[span]``; None when it cannot be measured
    (no log-probs, no answer span, or the tokens do not spell out ``text``: :func:`token_offset`)."""
    at = token_offset(logprobs, text)
    if at is None or span is None:
        return None
    s, e = span[0] + at, span[1] + at
    pos, lps = 0, []
    for tok, lp in logprobs:
        end = pos + len(tok)
        if end > s and pos < e:
            lps.append(lp)
        pos = end
    if not lps:
        return None
    return _unit(math.exp(sum(lps) / len(lps)))


def _unit(v: float) -> float:
    return round(min(1.0, max(0.0, v)), 6)


# -- one round's reading (shared by data collect and the gateway) ---------------------------------


@dataclasses.dataclass(frozen=True)
class BaseRead:
    """What the protocol takes from a base completion: ``answer`` ("" when unparsed), ``parsed``
    (an ``Answer:`` line was found), ``confidence`` (None when not measurable), ``shown`` (what
    the guide is asked to judge: the answer, or the whole completion when none was parsed)."""

    answer: str
    parsed: bool
    confidence: float | None
    shown: str


def read_base(text: str, logprobs: Sequence[tuple[str, float]] | None) -> BaseRead:
    """Parse a base completion and measure its confidence (the module doc's rules)."""
    p = parse_base_answer(text)
    conf = answer_confidence(logprobs, text, p[1] if p else None)
    return BaseRead(p[0] if p else "", p is not None, conf, p[0] if p else text.strip())


@dataclasses.dataclass(frozen=True)
class GuideRead:
    """The guide's reply read: ``verdict`` (True/False/None unreadable), ``answer`` (the base
    answer on Yes, the correction on No, "" when none), ``uncertainty`` (None when not measurable)."""

    verdict: bool | None
    correction: str | None
    answer: str
    uncertainty: float | None


def read_guide(text: str, logprobs: Sequence[tuple[str, float]] | None, base_answer: str) -> GuideRead:
    """Parse a guide reply and measure its uncertainty (an unreadable verdict has none)."""
    v = parse_verdict(text)
    ans = base_answer if v.correct is True else (v.correction or "")
    unc = verdict_uncertainty(logprobs) if v.correct is not None else None
    return GuideRead(v.correct, v.correction, ans, unc)


# -- messages ----------------------------------------------------------------------------------


def base_temperature(temperatures: tuple[float, float], t: int, cascade: bool) -> float:
    """Round ``t``'s (0-based) base temperature from (FIRST, LATER): FIRST at round 1, LATER after it,
    except in a guide-less cascade, whose round is each rung's own first answer to the question (no
    guide reply to retry on), so FIRST every round. One rule for ``data collect`` and the gateway."""
    return temperatures[0] if t == 0 or cascade else temperatures[1]


def base_messages(question: str, history: Sequence[tuple[str, str]], retry: str = "base") -> list[dict]:
    """The base model's chat at a round: ``history`` = [(its completion, feedback)] of earlier rounds.

    ``retry="base"``: the feedback is the guide's reply (:data:`BASE_RETRY`);
    ``retry="exit"``: LLM-EXIT's own next round (:data:`EXIT_RETRY`, feedback unused).
    """
    msgs = [{"role": "user", "content": BASE_PROMPT.format(question=question)}]
    for completion, feedback in history:
        msgs.append({"role": "assistant", "content": completion})
        nxt = BASE_RETRY.format(guide_reply=feedback.strip()) if retry == "base" else EXIT_RETRY
        msgs.append({"role": "user", "content": nxt})
    return msgs


def guide_messages(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": GUIDE_PROMPT.format(question=question, answer=answer)}]


def exit_messages(question: str, answers: Sequence[str]) -> list[dict]:
    lines = "\n".join(f"{i + 1}. {a if a else '(no valid answer)'}" for i, a in enumerate(answers))
    return [{"role": "user", "content": EXIT_PROMPT.format(question=question, answers=lines)}]


def policy_messages(question: str, rounds: Sequence[dict], T: int, coverage: float) -> list[dict]:
    """``rounds``: per round so far {"base", "verdict" (True/False/None), "guide", "uncertainty"}."""
    lines = []
    for t, r in enumerate(rounds):
        verdict = {True: "Yes (base answer judged correct)", False: "No", None: "unreadable"}[r["verdict"]]
        u = "n/a" if r.get("uncertainty") is None else f"{r['uncertainty']:.2f} (0 = certain, 1 = unsure)"
        lines.append(f"Round {t + 1} of {T}: base answer: {r['base'] or '(none)'}; guide verdict: {verdict}; "
                     f"guide answer: {r['guide'] or '(none)'}; guide uncertainty: {u}")
    last = len(rounds) >= T
    text = POLICY_PROMPT.format(coverage=f"{coverage:.0%}", next_line=POLICY_LAST if last else POLICY_NEXT,
                                question=question, rounds="\n".join(lines))
    return [{"role": "user", "content": text}]
