"""Statistics of a response cache: the text of ``ccpo-jax data check PATH``.

:func:`cache_stats` computes the numbers (NumPy, host), :func:`describe` lays
them out. Accuracy of round t is over the questions that have round t;
"verdict accuracy" is how often the guide's verdict (base answer judged
correct) equals the base answer's true correctness (arXiv 2511.11828: the guide judges
and corrects). Costs use the manifest's prices (USD per million tokens) and are
reported in cents, like the paper's tables.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from envs.replay.bound import bound_of_cache
from envs.cache.schema import ResponseCache, price_of
from envs.cache.values import printable as P


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


def cache_stats(cache: ResponseCache) -> dict[str, Any]:
    """Numbers shown by :func:`describe` (plain floats / lists, per round lists of length T)."""
    a, man = cache.arrays, cache.manifest
    mask = a["round_mask"]
    T = man.T
    n_rounds = cache.n_rounds
    per_round = lambda x: [_mean(x[:, t][mask[:, t]]) for t in range(T)]  # noqa: E731
    def cents(role: str) -> np.ndarray:  # [Q, T] cents of each call, at its round's prices
        m = man.models_of(role)
        if m is None:  # a guide-less cascade: no guide call
            return np.zeros(mask.shape, np.float32)
        return (a[f"{role}_tokens_in"] * price_of(m, "price_in") + a[f"{role}_tokens_out"] * price_of(m, "price_out")) / 1e4

    guide_cents, base_cents = cents("guide"), cents("base")
    verdict_ok = a["guide_verdict"] == a["base_correct"]
    n_answers = np.array([len(set(row[m].tolist()) | set(g[m & (g >= 0)].tolist()))  # a cascade's -1: no answer
                          for row, g, m in zip(a["base_answer"], a["guide_answer"], mask)])
    stats: dict[str, Any] = {
        "questions": cache.n_questions,
        "T": T,
        "rounds_hist": [int((n_rounds == k).sum()) for k in range(1, T + 1)],
        "questions_per_round": [int(mask[:, t].sum()) for t in range(T)],
        "base_acc": per_round(a["base_correct"]),
        "guide_acc": per_round(a["guide_correct"]),
        "verdict_acc": per_round(verdict_ok),
        "base_acc_all": _mean(a["base_correct"][mask]),
        "guide_acc_all": _mean(a["guide_correct"][mask]),
        "verdict_acc_all": _mean(verdict_ok[mask]),
        "verdict_says_correct": _mean(a["guide_verdict"][mask]),
        "unsolvable_share": _mean(cache.unsolvable),
        "gold_given": int((a["gold"] != "").sum()),
        "distinct_answers_mean": _mean(n_answers),
        "guide_tokens_in_mean": _mean(a["guide_tokens_in"][mask]),
        "guide_tokens_out_mean": _mean(a["guide_tokens_out"][mask]),
        "base_tokens_in_mean": _mean(a["base_tokens_in"][mask]),
        "base_tokens_out_mean": _mean(a["base_tokens_out"][mask]),
        "guide_cents_per_call": _mean(guide_cents[mask]),
        "base_cents_per_call": _mean(base_cents[mask]),
        "all_rounds_cents": float(cache.round_cost_cents().astype(np.float64).sum()),
        "confidence_given": _mean(~np.isnan(a["base_confidence"][mask])),
        "uncertainty_given": _mean(~np.isnan(a["guide_uncertainty"][mask])),
        "has_guide": man.has_guide,
        "exit": {},
        "llm_policy": {},
    }
    if man.is_ladder:  # per model of the ladder: its rounds, accuracy and cents per call
        stats["ladder"] = {}
        for role, acc, c in (("base", a["base_correct"], base_cents), ("guide", a["guide_correct"], guide_cents)):
            rows = stats["ladder"][role] = []
            for t, m in enumerate(man.rungs(role)):
                if rows and rows[-1]["name"] == m.name and rows[-1]["price_in"] == m.price_in \
                        and rows[-1]["price_out"] == m.price_out:
                    rows[-1]["rounds"].append(t + 1)
                else:
                    rows.append({**m.to_dict(), "rounds": [t + 1]})
            for r in rows:
                cols = [t - 1 for t in r["rounds"]]
                sel = mask[:, cols]
                r["calls"] = int(sel.sum())
                r["accuracy"] = _mean(acc[:, cols][sel])
                r["cents_per_call"] = _mean(c[:, cols][sel])
    for j, m in enumerate(man.exit_models):
        em = a["exit_mask"][:, j]
        stats["exit"][m] = {
            "questions": int(em.sum()),
            "accuracy": _mean(a["exit_correct"][:, j][em]),
            "rounds_mean": _mean(a["exit_rounds"][:, j][em]),
            "cost_cents_mean": _mean(a["exit_cost_cents"][:, j][em]),
        }
    for j, m in enumerate(man.llm_policy_models):
        acts = a["llm_policy_actions"][:, j]
        has = (acts >= 0).any(axis=1)
        length = (acts >= 0).sum(axis=1)
        stats["llm_policy"][m] = {"questions": int(has.sum()), "rounds_mean": _mean(length[has])}
    return stats


def _f(x: float, spec: str = ".3f") -> str:
    return "-" if x != x else format(x, spec)


def _bound_line(cache: ResponseCache, alpha: float = 0.1) -> str:
    """The clairvoyant bound (``envs.replay.bound``) with every question as one test set."""
    n = cache.n_questions
    if n == 0:
        return "clairvoyant bound: n/a (no questions)"
    b = bound_of_cache(cache, np.arange(n), alpha)
    return (f"clairvoyant bound at alpha {alpha:g}, all {n} questions as one test set: "
            f"{b['cost_cents']:.4g} cents ({b['cost_cents'] / n:.4g} per question, coverage {b['coverage']:.3f}); "
            "no router can be cheaper at that coverage")


def _signal_warnings(s: dict, prov: dict) -> list[str]:
    """What a cache without confidences or uncertainties cannot feed, and, for a collected cache
    that asked for log-probs, that the endpoint returned none."""
    req = prov.get("requests") if isinstance(prov.get("requests"), dict) else {}
    asked = ("; the collection asked for log-probs (provenance.requests.logprobs) and the endpoint returned "
             "none (docs/collect.md)") if req.get("logprobs") is True else ""
    out = []
    if s["uncertainty_given"] == 0 and s["has_guide"]:
        out.append("warning: no round has a guide uncertainty: reproduce leaves out the UALA row (it thresholds "
                   "the uncertainty) and the policies see has_guide_uncertainty = 0" + asked)
    if s["confidence_given"] == 0:
        out.append("warning: no round has a base confidence: the policies see has_base_confidence = 0" + asked)
    return out


def _groups_line(cache: ResponseCache) -> str:
    """``groups: N (smallest: NAME, K questions)`` or that the cache has none (Mondrian calibration needs them)."""
    g = cache.arrays.get("group")
    if g is None:
        return "groups:      none (no per-question 'group'; --calibration mondrian needs one)"
    names, counts = np.unique(np.asarray(g), return_counts=True)
    i = int(np.argmin(counts))
    return f"groups:      {len(names)}   smallest group: {str(names[i])!r} with {int(counts[i])} question(s)"


def _model_lines(man: Any, s: dict) -> list[str]:
    """The base and guide model lines; for a ladder, each model with its rounds, accuracy and cost."""
    lines = []
    for role, label in (("base", "base model: "), ("guide", "guide model:")):
        if role == "guide" and not man.has_guide:
            lines.append(f"{label} none (a cascade: models.guide is null, no guide call, no 'guide' action)")
            continue
        if "ladder" not in s or not (man.base_ladder if role == "base" else man.guide_ladder):
            m = man.base if role == "base" else man.guide
            lines.append(f"{label} {P(m.name)}  (${m.price_in:g} in / ${m.price_out:g} out per 1M tokens)")
            continue
        lines.append(f"{label} a ladder, one model per round:")
        for r in s["ladder"][role]:
            lines.append(f"  rounds {','.join(map(str, r['rounds']))}: {P(r['name'])}  (${r['price_in']:g} in / "
                         f"${r['price_out']:g} out per 1M tokens): {r['calls']} calls, accuracy {_f(r['accuracy'])}, "
                         f"{_f(r['cents_per_call'], '.4f')} cents per call")
    return lines


def _guide_rows(s: dict) -> list[str]:
    """The per-round guide and verdict accuracy rows (none in a guide-less cascade)."""
    if not s["has_guide"]:
        return []
    return ["guide accuracy     " + "".join(f"{_f(x):>8s}" for x in s["guide_acc"]) + f"{_f(s['guide_acc_all']):>8s}",
            "verdict accuracy   " + "".join(f"{_f(x):>8s}" for x in s["verdict_acc"]) + f"{_f(s['verdict_acc_all']):>8s}"]


def describe(cache: ResponseCache, source: str) -> str:
    """Human-readable summary of ``cache`` (loaded from ``source``); SYNTHETIC caches say so loudly."""
    man = cache.manifest
    s = cache_stats(cache)
    T = s["T"]
    prov = dict(man.provenance)
    kind = str(prov.pop("kind", "?"))
    banner = []
    if man.is_synthetic:
        banner = ["=" * 72, "SYNTHETIC CACHE: generated data, NOT real LLM responses", "=" * 72]
    lines = list(banner)
    lines += [
        f"cache:       {source}",
        # names and provenance come from the cache: quoted when not printable (P)
        f"name:        {P(man.name)}   task: {P(man.task)}   schema: v{man.schema_version}",
        f"provenance:  {kind.upper() if kind == 'synthetic' else P(kind)}"
        + "".join(f"; {P(k)}: {P(v)}" for k, v in prov.items()),
        *_model_lines(man, s),
        f"normalisation: {P(man.normalisation)}",
        f"questions:   {s['questions']}   T: {T}   gold answers given: {s['gold_given']}",
        _groups_line(cache),
        "rounds per question: " + ", ".join(
            f"{k + 1}: {n} ({n / max(s['questions'], 1):.1%})" for k, n in enumerate(s["rounds_hist"])),
        "",
        "round              " + "".join(f"{t + 1:>8d}" for t in range(T)) + "     all",
        "questions          " + "".join(f"{n:>8d}" for n in s["questions_per_round"]) + f"{sum(s['questions_per_round']):>8d}",
        "base accuracy      " + "".join(f"{_f(x):>8s}" for x in s["base_acc"]) + f"{_f(s['base_acc_all']):>8s}",
        *_guide_rows(s),
        "",
        f"unsolvable share (no correct answer in any round): {_f(s['unsolvable_share'])}",
        *([f"guide verdict 'base is correct' rate: {_f(s['verdict_says_correct'])}"] if s["has_guide"] else []),
        f"distinct normalised answers per question (mean): {_f(s['distinct_answers_mean'], '.2f')}",
        *([f"guide tokens per call (mean): in {_f(s['guide_tokens_in_mean'], '.1f')}, "
           f"out {_f(s['guide_tokens_out_mean'], '.1f')}"] if s["has_guide"] else []),
        f"base tokens per call (mean):  in {_f(s['base_tokens_in_mean'], '.1f')}, out {_f(s['base_tokens_out_mean'], '.1f')}",
        (f"cents per guide call (mean): {_f(s['guide_cents_per_call'], '.4f')}   " if s["has_guide"] else "cents ")
        + f"per base call: {_f(s['base_cents_per_call'], '.4f')}",
        f"cost of every existing round, all questions: {_f(s['all_rounds_cents'], '.2f')} cents",
        _bound_line(cache),
        f"base confidence given: {_f(s['confidence_given'], '.0%')} of rounds"
        + (f"; guide uncertainty given: {_f(s['uncertainty_given'], '.0%')} of rounds" if s["has_guide"] else
           " (no guide: a cascade)"),
    ]
    lines += _signal_warnings(s, prov)
    if s["exit"] or s["llm_policy"]:
        lines.append("cached baselines:")
        for m, e in s["exit"].items():
            lines.append(f"  {P(m)} EXIT: {e['questions']} questions, accuracy {_f(e['accuracy'])}, "
                         f"rounds {_f(e['rounds_mean'], '.2f')}, cost {_f(e['cost_cents_mean'], '.4f')} cents/question")
        for m, p in s["llm_policy"].items():
            lines.append(f"  LLM policy ({P(m)}): {p['questions']} questions, rounds {_f(p['rounds_mean'], '.2f')}")
    else:
        lines.append("cached baselines: none")
    lines.append(f"checksum:    {cache.checksum()} (the cache checksum: over the arrays and the manifest fields "
                 "that change results; not the file's sha256, which `data collect` prints)")
    lines += banner
    return "\n".join(lines)
