"""UALA's HotpotQA runs -> a two-round cascade cache (T = 2).

Sources (``tests/fixtures/SOURCES.md``, all MIT):

- Llama-2-70B UALA run: Hiro-221/Uncertainty-Aware-Language-Agent @cec94ef9,
  ``llama2_70b/llama2-hotpotqa-dev-uala-nooracle-20251022-040122.jsonl``;
- gpt-3.5-turbo-instruct UALA and ReAct runs: Jiuzhouh/Uncertainty-Aware-Language-Agent
  @f227a04a, ``outputs/HotpotQA/chatgpt-hotpotqa-dev-{uala,react}.jsonl``;

500 HotpotQA dev questions, the same in every file (joined by ``question_idx``).
``src`` is the ``uala`` folder (the one holding ``llama2_70b/`` and ``outputs/``).

Roles: Llama-2-70B (cheaper) is the base, gpt-3.5-turbo-instruct the guide.
Both answer the question themselves (neither judges the other), so this is a
cascade of two independent agents, not the CCPO judge protocol. Rounds:

- **round 1, chain of thought, no tools** (every question): base = Llama's
  CoT answer in its UALA trajectory (the answer UALA scored with
  ``MeasureUncertainty``; '' where the CoT gave none: 6 Llama, 25 gpt-3.5);
  guide = gpt-3.5's CoT answer from its own UALA trajectory. Base confidence = exp(-u) and guide
  uncertainty = 1 - exp(-u), where u >= 0 is the UALA uncertainty score of that
  CoT answer (``Observation 1: Answer's uncertainty is u``). UALA's scores are
  ln(k)-valued, so these are 1/k and 1 - 1/k; the maps are monotone, so UALA's
  threshold u = 1.79 becomes confidence 0.167 / uncertainty 0.833.
- **round 2, ReAct with the Wikipedia tool**, present only where Llama's UALA
  run escalated (its CoT uncertainty exceeded 1.79, "Activate Tool"; 101 of 500
  questions): base = that run's final answer (the tool answer, or the CoT
  answer when UALA fell back to it after an invalid tool answer), correct = the
  run's ``em``, confidence = exp(-u) of the tool answer where UALA measured it,
  else NaN; guide = gpt-3.5's answer in its separate ReAct run of the same
  question, correct = that run's ``em``, uncertainty NaN (not measured).
  Questions without escalation have one round: the data has no second Llama
  attempt for them, and none is invented.

Correctness = exact match after ``envs.cache.normalise.normalise_answer`` (SQuAD
style: lower case, no punctuation, no articles, single spaces), which
reproduces every ``em`` field of these three files (tested); answer ids use the
same normalisation. Guide verdict = the two
normalised answers are equal. Gold = ``gt_answer``.

Tokens (not recorded): ceil(chars / 4) of the recorded trajectory text of that
round; ``Question:`` and ``Observation`` text count as input, everything else
(thoughts, actions, answers) as output. The few-shot prompts and ReAct's
re-sending of its scratchpad at every step are not recorded, so token counts and
cents are lower bounds. Prices: ``envs.importers.pricing.PRICES``.

No cached EXIT or LLM-policy baselines: UALA's own runs decide by an
uncertainty threshold, which is the UALA baseline, not an LLM-EXIT run.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from envs.cache.schema import CacheError, ModelInfo, ResponseCache
from envs.cache.tokens import tokens_for_chars
from envs.importers import Side, build_cache
from envs.cache.normalise import normalise_answer
from envs.importers.pricing import model_info, price_sources

BASE = "meta-llama/Llama-2-70b-hf"
GUIDE = "gpt-3.5-turbo-instruct"
LLAMA_FILE = "llama2_70b/llama2-hotpotqa-dev-uala-nooracle-20251022-040122.jsonl"
GPT_UALA_FILE = "outputs/HotpotQA/chatgpt-hotpotqa-dev-uala.jsonl"
GPT_REACT_FILE = "outputs/HotpotQA/chatgpt-hotpotqa-dev-react.jsonl"
UALA_THRESHOLD = 1.79

#: Provenance shared by both imports of these runs.
_SOURCE = {
    "kind": "real",
    "source": (
        f"Hiro-221/Uncertainty-Aware-Language-Agent @cec94ef9, {LLAMA_FILE}; "
        f"Jiuzhouh/Uncertainty-Aware-Language-Agent @f227a04a, {GPT_UALA_FILE} and {GPT_REACT_FILE}"
    ),
    "license": "MIT (outputs); HotpotQA questions CC BY-SA 4.0",
}

_MEASURE = re.compile(r"^Action 1: MeasureUncertainty \[(.*?)\]\s*$", re.M | re.S)
_UNC = re.compile(r"Answer.s uncertainty is ([0-9.]+)")


def _read_jsonl(path: Path, fields: tuple[str, ...]) -> dict[int, dict]:
    if not path.is_file():
        raise CacheError(f"{path}: no such file (the uala-hotpotqa importer needs it)")
    out: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CacheError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise CacheError(f"{path}: line {n}: expected a JSON object")
            for k in fields:
                if k not in rec:
                    raise CacheError(f"{path}: line {n}: missing field '{k}'")
            if not isinstance(rec["em"], bool) and rec["em"] not in (0, 1):
                raise CacheError(f"{path}: line {n}, field 'em': expected true or false, got {rec['em']!r}")
            if not isinstance(rec["traj"], str):
                raise CacheError(f"{path}: line {n}, field 'traj': expected a string")
            rec["_line"] = n
            qi = rec["question_idx"]
            if isinstance(qi, bool) or not isinstance(qi, int):
                raise CacheError(f"{path}: line {n}, field 'question_idx': expected an integer, got {qi!r}")
            if qi in out:
                raise CacheError(f"{path}: line {n}: duplicate question_idx {qi} (first on line {out[qi]['_line']})")
            out[qi] = rec
    if not out:
        raise CacheError(f"{path}: empty file (no records)")
    return out


def _split_tokens(lines: list[str]) -> tuple[int, int]:
    """(input, output) token estimates of trajectory lines: Question/Observation -> input."""
    n_in = n_out = 0
    to_input = False
    for line in lines:
        if line.startswith(("Question:", "Observation")):
            to_input = True
        elif line.startswith(("Thought", "Action", "Answer")):
            to_input = False
        if to_input:
            n_in += len(line) + 1
        else:
            n_out += len(line) + 1
    return tokens_for_chars(n_in), tokens_for_chars(n_out)


def _cot_part(rec: dict, path: Path) -> tuple[str, float, list[str]]:
    """(CoT answer, its UALA uncertainty u, trajectory lines of the CoT call).

    The CoT answer is the argument of the first ``MeasureUncertainty [...]`` action (what UALA
    scored; its first line, since a few Llama arguments run on into a stray 'Question' line).
    It is '' when the CoT produced no answer. The CoT call's text is everything before
    ``Action 1:`` (question, thought, optional ``Answer:`` line).
    """
    traj = rec["traj"]
    m = _MEASURE.search(traj)
    u = _UNC.search(traj)
    if m is None or u is None:
        raise CacheError(
            f"{path}: line {rec['_line']}, field 'traj': no 'Action 1: MeasureUncertainty [...]' "
            "with a measured uncertainty (not a UALA trajectory)"
        )
    answer = m.group(1).split("\n")[0].strip()
    return answer, float(u.group(1)), traj[: m.start()].rstrip("\n").split("\n")


def _tool_part(rec: dict) -> tuple[list[str], float]:
    """Trajectory lines after 'Activate Tool' and the uncertainty of the tool answer (NaN if none)."""
    traj = rec["traj"]
    i = traj.index("Activate Tool")
    rest = traj[i:].split("\n")[1:]
    uncs = _UNC.findall(traj[i:])
    return rest, float(uncs[-1]) if uncs else float("nan")


#: HotpotQA dev set (question, answer, type) inside the uala folder: the source of each question's group.
DEV_FILE = "hotpotqa/hotpot_dev_v1_simplified.json"


def _question_types(src: Path, llama: dict[int, dict]) -> dict[int, str] | None:
    """question_idx -> HotpotQA question type (bridge / comparison) from ``src/DEV_FILE``, or None without it.

    ``question_idx`` indexes the dev list; each gold answer must equal the dev set's (else the file is not the
    one the runs used, and the import is refused naming the question)."""
    path = src / DEV_FILE
    if not path.is_file():
        return None
    try:
        dev = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(dev, list):
        raise CacheError(f"{path}: expected a JSON list of {{question, answer, type}} records")
    out = {}
    for qi, rec in llama.items():
        if not 0 <= qi < len(dev) or not isinstance(dev[qi], dict):
            raise CacheError(f"{path}: no record {qi} (question_idx of the runs; the dev list has {len(dev)})")
        if dev[qi].get("answer") != rec["gt_answer"]:
            raise CacheError(f"{path}: record {qi}: answer {dev[qi].get('answer')!r} differs from the runs' "
                             f"gt_answer {rec['gt_answer']!r}; not the dev set the runs used")
        kind = dev[qi].get("type")
        if not isinstance(kind, str) or not kind:
            raise CacheError(f"{path}: record {qi}, field 'type': expected a non-empty string, got {kind!r}")
        out[qi] = kind
    return out


def _read_runs(src: Path) -> tuple[dict, dict, dict, dict[int, str] | None, list[Path]]:
    """The three runs (Llama UALA, gpt-3.5 UALA, gpt-3.5 ReAct) keyed by question_idx, checked to hold the same
    questions with the same gold answers, the question types (or None) and the three paths."""
    if not src.is_dir():
        raise CacheError(f"{src}: expected the uala folder (holding {LLAMA_FILE} and {GPT_UALA_FILE})")
    fields = ("question_idx", "answer", "gt_answer", "em", "traj")
    paths = [src / LLAMA_FILE, src / GPT_UALA_FILE, src / GPT_REACT_FILE]
    llama, gpt, react = (_read_jsonl(p, fields) for p in paths)
    for p, d in zip(paths[1:], (gpt, react)):
        if set(d) != set(llama):
            raise CacheError(f"{p}: its question_idx set differs from {paths[0]}'s")
    for qi, lr in llama.items():
        for p, d in zip(paths[1:], (gpt, react)):
            if d[qi]["gt_answer"] != lr["gt_answer"]:
                raise CacheError(f"{p}: line {d[qi]['_line']}: gt_answer differs from {paths[0]} for question_idx {qi}")
    return llama, gpt, react, _question_types(src, llama), paths


def load_hotpotqa(src: Path) -> ResponseCache:
    """Build the T = 2 cascade cache from the ``uala`` folder ``src`` (see module docstring)."""
    llama, gpt, react, types, paths = _read_runs(src)
    ids, gold, rounds = [], [], []
    for qi, lr in llama.items():  # file order of the Llama run
        gr, rr = gpt[qi], react[qi]
        gt = lr["gt_answer"]
        g_norm = normalise_answer(gt)

        b_ans, b_u, b_lines = _cot_part(lr, paths[0])
        g_ans, g_u, g_lines = _cot_part(gr, paths[1])
        b_key, g_key = normalise_answer(b_ans), normalise_answer(g_ans)
        b = Side(b_key, b_key == g_norm, *_split_tokens(b_lines), score=math.exp(-b_u))
        g = Side(g_key, g_key == g_norm, *_split_tokens(g_lines), score=1.0 - math.exp(-g_u))
        rs = [(b, g)]
        if "Activate Tool" in lr["traj"]:
            tool_lines, tool_u = _tool_part(lr)
            b2 = Side(normalise_answer(lr["answer"]), bool(lr["em"]), *_split_tokens(tool_lines), score=math.exp(-tool_u))
            g2 = Side(normalise_answer(rr["answer"]), bool(rr["em"]), *_split_tokens(rr["traj"].split("\n")))
            rs.append((b2, g2))
        ids.append(f"hotpotqa-dev/{qi}")
        gold.append(gt)
        rounds.append(rs)
    prov = {
        **_SOURCE,
        "protocol": "two-round cascade of two independent agents (round 1 CoT, round 2 ReAct with Wikipedia, "
        "present only where the Llama UALA run escalated), not the CCPO multi-round judge protocol",
        "base": f"{BASE} (UALA run: CoT answer, then its ReAct/tool answer when escalated)",
        "guide": f"{GUIDE} (UALA run's CoT answer in round 1; its ReAct run's answer in round 2)",
        "verdict": "guide verdict = normalised guide answer equals normalised base answer (agreement)",
        "uncertainty": "UALA score u >= 0 (ln k-valued); base_confidence = exp(-u), guide_uncertainty = 1 - exp(-u); "
        f"UALA threshold u = {UALA_THRESHOLD}; NaN where not measured",
        "tokens": "ceil(chars/4) of the round's recorded trajectory text (Question/Observation -> input, rest -> "
        "output); few-shot prompts and re-sent scratchpads not recorded: a lower bound",
        "prices": price_sources(BASE, GUIDE),
    }
    return build_cache(
        name="uala-hotpotqa",
        task="hotpotqa",
        base=model_info(BASE),
        guide=model_info(GUIDE),
        provenance=prov,
        question_ids=ids,
        gold=gold,
        rounds=rounds,
        T=2,
        groups=None if types is None else [types[qi] for qi in llama],
    )


#: Rung 3's model name in the ladder: the guide model run as a ReAct agent with the Wikipedia tool.
REACT_RUNG = f"{GUIDE} (ReAct + Wikipedia)"


def load_hotpotqa_ladder(src: Path) -> ResponseCache:
    """Format ``uala-ladder``: the same runs as a three-rung guide-less ladder with confidences (T = 3).

    Every question has every rung, each the model's own answer (no judge): rung 1 Llama-2-70B's CoT answer,
    confidence exp(-u) of its UALA score; rung 2 gpt-3.5-turbo-instruct's CoT answer, confidence exp(-u);
    rung 3 gpt-3.5-turbo-instruct's ReAct run with Wikipedia (about 7x rung 2's tokens), no confidence
    (NaN: not measured). Rungs 2 and 3 are one model at one price; rung 3 costs more by its tokens. Tokens,
    normalisation and prices as :func:`load_hotpotqa`. Correct = exact match (rungs 1-2) or the ReAct run's
    ``em`` (rung 3), as there.
    """
    from envs.importers.ladder import LADDER_PROTOCOL, build_ladder  # ladder.py imports this package's helpers

    llama, gpt, react, types, paths = _read_runs(src)
    ids, gold, answers = [], [], []
    for qi, lr in llama.items():
        g_norm = normalise_answer(lr["gt_answer"])
        sides = []
        for rec, path in ((lr, paths[0]), (gpt[qi], paths[1])):
            ans, u, lines = _cot_part(rec, path)
            key = normalise_answer(ans)
            sides.append(Side(key, key == g_norm, *_split_tokens(lines), score=math.exp(-u)))
        rr = react[qi]
        sides.append(Side(normalise_answer(rr["answer"]), bool(rr["em"]), *_split_tokens(rr["traj"].split("\n"))))
        ids.append(f"hotpotqa-dev/{qi}")
        gold.append(lr["gt_answer"])
        answers.append(sides)
    guide = model_info(GUIDE)
    rungs = (model_info(BASE), guide, ModelInfo(REACT_RUNG, guide.price_in, guide.price_out))
    prov = {
        **_SOURCE,
        "protocol": LADDER_PROTOCOL,
        "rungs": f"1 {BASE} CoT; 2 {GUIDE} CoT; 3 {GUIDE} ReAct with Wikipedia (its separate ReAct run)",
        "confidence": "rungs 1-2: exp(-u) of the CoT answer's UALA score u (ln k-valued, so 1/k); rung 3: none",
        "tokens": "ceil(chars/4) of the rung's recorded trajectory text (Question/Observation -> input, rest -> "
        "output); few-shot prompts and re-sent scratchpads not recorded: a lower bound",
        "prices": price_sources(BASE, GUIDE),
        "questions_dropped": 0,
    }
    return build_ladder(name="uala-hotpotqa-ladder", task="hotpotqa", rungs=rungs, provenance=prov,
                        question_ids=ids, gold=gold, answers=answers,
                        groups=None if types is None else [types[qi] for qi in llama])
