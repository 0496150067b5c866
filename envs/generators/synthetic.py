"""Synthetic response caches calibrated to the CCPO paper's reported marginals.

The built-in default cache (docs/caches.md, "Synthetic response caches"); the
targets come from arXiv 2511.11828, Tables 2-5 (:mod:`envs.published`), and from our price analysis of
those tables (the paper states no token prices). Every cache made here says ``provenance.kind =
'synthetic'``: these are NOT LLM outputs, only a generative model whose
marginals resemble the paper's.

Generative model (all choices are ours; the paper publishes no data):

* Each question q has a latent difficulty ``d_q ~ N(0, 1)`` and a random
  permutation of the answer labels ``0 .. 2T-1``: the first is the gold answer,
  the others form a pool of wrong answers (HotpotQA: 7, MMLU: 3 wrong options).
  Wrong answers are drawn from the pool with geometric weights, so the same
  wrong answer recurs across rounds and models. Texts are ``"synthetic answer
  <label>"``; the cache's answer ids number them in order of first appearance
  (base r1, guide r1, base r2, ...), as ``envs.cache.jsonl`` does, so a JSONL export
  and import keeps the checksum.
* **Base** (LLaMA) at round t: a *fresh* attempt is correct iff
  ``mu_b + delta_t - s_b d_q + eps > 0`` (probit; ``delta_t`` grows with t:
  retry gains). From round 2 on the base sees the guide's previous output: after
  a guide "No [answer]" it adopts the guide's answer with probability
  ``p_adopt``; otherwise it repeats its previous answer with probability
  ``p_repeat_right`` / ``p_repeat_wrong`` (repeats are likelier when it was
  right), else makes a fresh attempt.
* **Guide** (GPT-4o) at round t either *knows* the answer
  (``mu_g - s_g d_q + eps > 0``) or not. Knowing, it judges the base answer
  correctly except with probability ``p_misjudge`` and, when it says "No",
  gives the gold answer. Not knowing, it says "Yes" with probability
  ``p_yes_unknown + p_yes_informative * base_correct`` and its "No" answer is
  the gold only by luck (``p_lucky``), else a wrong answer different from the
  base's. A "Yes" means the guide's answer IS the base answer.
* **Guide uncertainty** ``sigmoid(u0 + u_unknown [not knows] + u_no [verdict No]
  + u_d d_q + u_sd N)``: higher when the guide does not know (hence when it is
  wrong) and on hard questions. **Base confidence**: weakly tied to base
  correctness and difficulty.
* **Tokens**: guide input = template + question tokens (log-normal per question)
  + base-answer tokens; guide output = 1 ("Yes") or 2 + corrected-answer tokens.
  At GPT-4o list prices ($2.50 / $10 per million) this gives about 0.022 cents
  per guide call on HotpotQA and 0.039 on MMLU (our derivation from Tables 2-5). Base (LLaMA, price
  0) tokens grow over rounds as the context accumulates earlier rounds.
* **Cached baselines**. EXIT runs of ``gpt-4o`` and of the base (the single-LLM
  LLM-EXIT baseline): correct iff ``e0 - e_d d_q + N > 0``; it continues past
  round t iff ``c0 + c_d d_q + c_wrong [not correct] + N > 0``; GPT-4o cost =
  rounds x a log-normal per-round cost. LLM-as-policy actions of ``gpt-4o`` and
  of the base: at each round the policy goes to the next round with probability
  ``Phi(n0 + n_err [no correct answer this round] + n_unc (uncertainty - 0.5))``,
  and when it stops picks base or guide; ``skill`` in [-1, 1] is the chance it
  picks the correct one of the two when exactly one is correct (negative: the
  wrong one), else it picks the guide with probability ``p_guide``.

The free parameters of each profile (``mu_b, mu_g, s``, the question-token
scale, the EXIT offsets and costs, the LLM-policy ``n0`` and ``skill``) were fit
by :func:`calibrate` on 50,000 questions (``python -m envs.generators.synthetic
--calibrate PROFILE``) and are written in :mod:`envs.generators.synthetic_profiles`, with
the targets; the rest are fixed by hand. Only the paper's
non-learned rows are targets; the learned rows (CPO, CCPO) are outcomes.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Callable, NamedTuple

import numpy as np

from envs.cache.schema import CacheError, Manifest, ModelInfo, ResponseCache, empty_arrays
from envs.generators.synthetic_profiles import (
    DEFAULT_PROFILE,
    GUIDE,
    PAPER,
    PROFILES,
    T_ROUNDS,
    ChainParams,
    Profile,
    TokenParams,
    get_profile,
)

DEFAULT_QUESTIONS = 1400


# ---------------------------------------------------------------------------
# measurement (what the targets mean)


def per_question_marginals(cache: ResponseCache) -> dict[str, np.ndarray]:
    """Per-question values whose means are the calibrated marginals ([Q] each).

    * ``unsolvable``: no base or guide answer of any round is correct.
    * ``guide_round1_coverage``: guide round-1 answer correct, or unsolvable
      (the level a pointwise policy stopping at round 1 reaches; CPO rows).
    * ``random_coverage``: exact expected coverage of the uniform random policy
      (arXiv 2511.11828 §5; "next" unavailable at the last round), by enumeration.
    * ``random_len``: its expected length.
    * ``cents_per_guide_call``: mean guide cost of the question's rounds.
    * ``guide_verdict_accuracy``: share of rounds where verdict == base correct.
    * ``<m>_exit_coverage`` / ``_len`` / ``_cost_per_200``: matched coverage
      (correct or unsolvable, paper footnote), rounds, 200 x cost.
    * ``<m>_policy_coverage`` / ``_len``: LLM-policy answer correct or
      unsolvable; rounds until it answered.
    ``<m>`` is ``gpt4o`` or ``base``.
    """
    a = cache.arrays
    mask = a["round_mask"]
    n_r = mask.sum(1)
    unsolv = cache.unsolvable
    bc, gc = a["base_correct"] & mask, a["guide_correct"] & mask
    out: dict[str, np.ndarray] = {"unsolvable": unsolv.astype(float)}
    out["guide_round1_coverage"] = (gc[:, 0] | unsolv).astype(float)
    # Uniform random policy: reach round t with prob (1/3)^(t-1); at a round that is
    # not the last existing one pick base/guide/next with 1/3 each, at the last 1/2 base/guide.
    T = mask.shape[1]
    t = np.arange(T)
    reach = np.where(mask, (1.0 / 3.0) ** t, 0.0)
    last = t[None, :] == (n_r[:, None] - 1)
    p_each = np.where(last, 0.5, 1.0 / 3.0)
    hit = (reach * p_each * (bc.astype(float) + gc.astype(float))).sum(1)
    out["random_coverage"] = np.where(unsolv, 1.0, hit)
    out["random_len"] = reach.sum(1)
    guide_cents = (
        a["guide_tokens_in"] * cache.manifest.guide.price_in + a["guide_tokens_out"] * cache.manifest.guide.price_out
    ) / 1e4
    out["cents_per_guide_call"] = np.where(mask, guide_cents, 0.0).sum(1) / n_r
    out["guide_verdict_accuracy"] = ((a["guide_verdict"] == a["base_correct"]) & mask).sum(1) / n_r
    for j, model in enumerate(cache.manifest.exit_models):
        key = "gpt4o" if model == GUIDE.name else "base"
        out[f"{key}_exit_coverage"] = (a["exit_correct"][:, j] | unsolv).astype(float)
        out[f"{key}_exit_len"] = a["exit_rounds"][:, j].astype(float)
        out[f"{key}_exit_cost_per_200"] = 200.0 * a["exit_cost_cents"][:, j].astype(float)
    for j, model in enumerate(cache.manifest.llm_policy_models):
        key = "gpt4o" if model == GUIDE.name else "base"
        acts = a["llm_policy_actions"][:, j]
        stop = np.argmax((acts == 0) | (acts == 1), axis=1)
        act = np.take_along_axis(acts, stop[:, None], 1)[:, 0]
        ok = np.where(act == 0, bc[np.arange(len(stop)), stop], gc[np.arange(len(stop)), stop])
        out[f"{key}_policy_coverage"] = (ok | unsolv).astype(float)
        out[f"{key}_policy_len"] = (stop + 1).astype(float)
    return out


def measure(cache: ResponseCache) -> dict[str, float]:
    """Means of :func:`per_question_marginals` (the calibrated marginals)."""
    return {k: float(v.mean()) for k, v in per_question_marginals(cache).items()}


def base_accuracy_by_round(cache: ResponseCache) -> np.ndarray:
    """[T] share of existing rounds whose base answer is correct (retry gains)."""
    a = cache.arrays
    return (a["base_correct"] & a["round_mask"]).sum(0) / np.maximum(a["round_mask"].sum(0), 1)


# ---------------------------------------------------------------------------
# generation


def _wrong_slot(u: np.ndarray, p: float, n_wrong: int) -> np.ndarray:
    """Geometric(p) index into the wrong-answer pool, folded into [0, n_wrong)."""
    k = np.floor(np.log1p(-u) / math.log1p(-p)).astype(np.int64)
    return np.minimum(k, n_wrong - 1)


class _Draws(NamedTuple):
    """Every random number of one synthetic cache, drawn by :func:`_draw` in a fixed order."""

    d: np.ndarray  # [Q] latent difficulty
    perm: np.ndarray  # [Q, 2T] answer labels: gold, then the wrong pool
    z_base: np.ndarray
    z_guide: np.ndarray
    u_wrong_b: np.ndarray
    u_wrong_g: np.ndarray
    u_adopt: np.ndarray
    u_repeat: np.ndarray
    u_mis: np.ndarray
    u_yes: np.ndarray
    u_lucky: np.ndarray
    z_unc: np.ndarray
    z_conf: np.ndarray
    z_qtok: np.ndarray
    ans_tok: np.ndarray  # [Q, 2T] tokens of each answer text
    z_bout: np.ndarray
    z_obs: np.ndarray
    z_exit_ok: np.ndarray
    z_exit_cont: np.ndarray
    z_exit_cost: np.ndarray
    z_pol_next: np.ndarray
    u_pol_smart: np.ndarray
    u_pol_pick: np.ndarray


def _draw(seed: int, Q: int, T: int, ans_tokens: float) -> _Draws:
    """All draws, in a fixed order and fixed shapes, before any other parameter is used
    (common random numbers: the same seed gives the same draws for every parameter value)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    A = 2 * T
    d = rng.standard_normal(Q)
    perm = np.argsort(rng.random((Q, A)), axis=1).astype(np.int32)  # [Q, 2T]: gold, then wrong pool
    z_base = rng.standard_normal((Q, T))
    z_guide = rng.standard_normal((Q, T))
    u_wrong_b, u_wrong_g = rng.random((Q, T)), rng.random((Q, T))
    u_adopt, u_repeat = rng.random((Q, T)), rng.random((Q, T))
    u_mis, u_yes, u_lucky = rng.random((Q, T)), rng.random((Q, T)), rng.random((Q, T))
    z_unc, z_conf = rng.standard_normal((Q, T)), rng.standard_normal((Q, T))
    z_qtok = rng.standard_normal(Q)
    ans_tok = 1 + rng.poisson(ans_tokens, (Q, A))  # tokens of each answer text
    z_bout, z_obs = rng.standard_normal((Q, T)), rng.standard_normal((Q, T))
    z_exit_ok = rng.standard_normal((Q, 2))
    z_exit_cont = rng.standard_normal((Q, 2, T))
    z_exit_cost = rng.standard_normal((Q, 2, T))
    z_pol_next = rng.standard_normal((Q, 2, T))
    u_pol_smart, u_pol_pick = rng.random((Q, 2, T)), rng.random((Q, 2, T))
    return _Draws(d, perm, z_base, z_guide, u_wrong_b, u_wrong_g, u_adopt, u_repeat, u_mis, u_yes, u_lucky,
                  z_unc, z_conf, z_qtok, ans_tok, z_bout, z_obs, z_exit_ok, z_exit_cont, z_exit_cost,
                  z_pol_next, u_pol_smart, u_pol_pick)


def _chain(c: ChainParams, r: _Draws, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The base/guide chain (module docstring): ``[Q, T]`` base and guide answer labels,
    the guide's verdict and whether the guide knows the answer."""
    Q, A = len(r.d), 2 * T
    rows = np.arange(Q)
    gold = r.perm[:, 0]
    nw = min(c.n_wrong, A - 1)
    wrong_b = r.perm[rows[:, None], 1 + _wrong_slot(r.u_wrong_b, c.p_wrong_geom, nw)]  # [Q, T]
    slot_g = _wrong_slot(r.u_wrong_g, c.p_wrong_geom, nw)
    knows = (c.mu_g - c.s * r.d[:, None] + r.z_guide) > 0  # [Q, T]
    base = np.empty((Q, T), np.int32)
    guide = np.empty((Q, T), np.int32)
    verdict = np.empty((Q, T), bool)
    for t in range(T):  # T = 4 rounds; every step is vectorised over questions
        fresh_ok = (c.mu_b + c.delta[min(t, len(c.delta) - 1)] - c.s * r.d + r.z_base[:, t]) > 0
        fresh = np.where(fresh_ok, gold, wrong_b[:, t])
        if t == 0:
            b = fresh
        else:
            prev_ok = base[:, t - 1] == gold
            adopt = ~verdict[:, t - 1] & (r.u_adopt[:, t] < c.p_adopt)
            repeat = r.u_repeat[:, t] < np.where(prev_ok, c.p_repeat_right, c.p_repeat_wrong)
            b = np.where(adopt, guide[:, t - 1], np.where(repeat, base[:, t - 1], fresh))
        b_ok = b == gold
        v_known = b_ok ^ (r.u_mis[:, t] < c.p_misjudge)
        v_unknown = r.u_yes[:, t] < c.p_yes_unknown + c.p_yes_informative * b_ok
        v = np.where(knows[:, t], v_known, v_unknown)
        # "No [answer]": the gold when the guide knows (or is lucky) and the base is wrong;
        # otherwise a wrong answer different from the base's.
        g_gold = ~b_ok & (knows[:, t] | (r.u_lucky[:, t] < c.p_lucky))
        g_wrong = r.perm[rows, 1 + slot_g[:, t]]
        g_wrong = np.where(g_wrong == b, r.perm[rows, 1 + (slot_g[:, t] + 1) % nw], g_wrong)
        base[:, t] = b
        verdict[:, t] = v
        guide[:, t] = np.where(v, b, np.where(g_gold, gold, g_wrong))
    return base, guide, verdict, knows


def _tokens(tk: TokenParams, r: _Draws, base: np.ndarray, guide: np.ndarray,
            verdict: np.ndarray) -> dict[str, np.ndarray]:
    """Token counts of every round (module docstring), ``[Q, T]`` each."""
    Q = len(r.d)
    lsd = math.sqrt(math.log1p(tk.q_cv**2))
    q_tok = np.round(tk.q_tokens * np.exp(lsd * r.z_qtok - 0.5 * lsd**2))
    g_in = tk.template + q_tok[:, None] + np.take_along_axis(r.ans_tok, base, 1)
    g_out = np.where(verdict, 1, 2 + np.take_along_axis(r.ans_tok, guide, 1))
    b_out = np.round(tk.base_out * np.exp(0.4 * r.z_bout - 0.08))
    obs = np.round(tk.base_obs * np.exp(0.5 * r.z_obs - 0.125))
    ctx = b_out + obs + g_out + 10  # what each round adds to the base's context
    b_in = tk.base_system + q_tok[:, None] + np.concatenate([np.zeros((Q, 1)), np.cumsum(ctx, 1)[:, :-1]], 1)
    return {"guide_tokens_in": g_in, "guide_tokens_out": g_out, "base_tokens_in": b_in, "base_tokens_out": b_out}


def _exit_runs(profile: Profile, r: _Draws, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cached LLM-EXIT runs of gpt-4o and the base: ``[Q, 2]`` correct, rounds, cents."""
    Q, d = len(r.d), r.d
    exit_ok = np.empty((Q, 2), bool)
    exit_rounds = np.empty((Q, 2), np.int32)
    exit_cost = np.empty((Q, 2), np.float32)
    for j, e in enumerate((profile.exit_gpt4o, profile.exit_base)):
        ok = (e.e0 - e.e_d * d + r.z_exit_ok[:, j]) > 0
        cont = (e.c0 + e.c_d * d[:, None] + e.c_wrong * ~ok[:, None] + r.z_exit_cont[:, j, : T - 1]) > 0
        rounds = 1 + np.cumprod(cont, axis=1).sum(1)
        csd = math.sqrt(math.log1p(e.cost_cv**2))
        per_round = e.cost_round * np.exp(csd * r.z_exit_cost[:, j] - 0.5 * csd**2)
        exit_ok[:, j] = ok
        exit_rounds[:, j] = rounds
        exit_cost[:, j] = np.where(np.arange(T)[None, :] < rounds[:, None], per_round, 0.0).sum(1)
    return exit_ok, exit_rounds, exit_cost


def _policy_actions(profile: Profile, r: _Draws, base_ok: np.ndarray, guide_ok: np.ndarray,
                    unc: np.ndarray, T: int) -> np.ndarray:
    """The cached LLM-as-policy actions of gpt-4o and the base: ``[Q, 2, T]`` (-1 after stopping)."""
    Q = len(r.d)
    actions = np.full((Q, 2, T), -1, np.int32)
    for j, p in enumerate((profile.policy_gpt4o, profile.policy_base)):
        alive = np.ones(Q, bool)
        for t in range(T):
            none_ok = ~(base_ok[:, t] | guide_ok[:, t])
            go_on = (p.n0 + p.n_err * none_ok + p.n_unc * (unc[:, t] - 0.5) + r.z_pol_next[:, j, t]) > 0
            go_on &= t < T - 1
            one_ok = base_ok[:, t] ^ guide_ok[:, t]
            smart = one_ok & (r.u_pol_smart[:, j, t] < abs(p.skill))
            pick_correct = np.where(guide_ok[:, t], 1, 0)
            pick = np.where(
                smart,
                pick_correct if p.skill >= 0 else 1 - pick_correct,
                (r.u_pol_pick[:, j, t] < p.p_guide).astype(np.int32),
            )
            actions[:, j, t] = np.where(alive, np.where(go_on, 2, pick), -1)
            alive &= go_on
    return actions


def _simulate(profile: Profile, n: int, seed: int, T: int = T_ROUNDS) -> dict[str, np.ndarray]:
    """All arrays of a synthetic cache (module docstring), vectorised over questions.

    Random numbers are drawn in fixed shapes before any parameter is used, so a
    seed gives the same draws for every parameter value (common random numbers,
    which keeps :func:`calibrate`'s bisections smooth). Returns ``[Q, T]`` round
    arrays, ``[Q, 2T]`` answer-label permutation (gold first), and ``[Q, 2]`` / ``[Q, 2, T]``
    baseline arrays in the order of :attr:`Profile.models`.
    """
    c = profile.chain
    r = _draw(seed, n, T, profile.tokens.ans_tokens)
    base, guide, verdict, knows = _chain(c, r, T)
    gold = r.perm[:, 0]
    base_ok, guide_ok = base == gold[:, None], guide == gold[:, None]

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    d = r.d
    unc = sigmoid(c.u0 + c.u_unknown * ~knows + c.u_no * ~verdict + c.u_d * d[:, None] + c.u_sd * r.z_unc)
    conf = sigmoid(c.conf0 + c.conf_correct * base_ok + c.conf_d * d[:, None] + c.conf_sd * r.z_conf)
    tokens = _tokens(profile.tokens, r, base, guide, verdict)
    exit_ok, exit_rounds, exit_cost = _exit_runs(profile, r, T)
    return {
        "d": d,
        "perm": r.perm,
        "base_answer": base,
        "base_correct": base_ok,
        "guide_answer": guide,
        "guide_correct": guide_ok,
        "guide_verdict": verdict,
        "guide_uncertainty": unc.astype(np.float32),
        "base_confidence": conf.astype(np.float32),
        **{k: v.astype(np.float32) for k, v in tokens.items()},
        "exit_correct": exit_ok,
        "exit_rounds": exit_rounds,
        "exit_cost_cents": exit_cost,
        "llm_policy_actions": _policy_actions(profile, r, base_ok, guide_ok, unc, T),
    }


def generate(profile: str | Profile = DEFAULT_PROFILE, n_questions: int = DEFAULT_QUESTIONS, seed: int = 0) -> ResponseCache:
    """A SYNTHETIC response cache of ``n_questions`` questions and T = 4 rounds.

    Deterministic per ``seed`` (``numpy.random.Generator(PCG64(seed))``). The
    manifest's provenance is ``{"kind": "synthetic", "generator":
    "envs.synthetic/<profile>", "seed": seed, "calibrated_to": ...}``; the cache
    carries its checksum. Raises :class:`envs.cache.schema.CacheError` for an unknown
    profile (naming the valid ones) or a bad size/seed.
    """
    prof = get_profile(profile)
    if isinstance(n_questions, bool) or not isinstance(n_questions, (int, np.integer)) or n_questions < 1:
        raise CacheError(f"synthetic cache: the number of questions must be an integer >= 1, got {n_questions!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise CacheError(f"synthetic cache: the seed must be an integer >= 0, got {seed!r}")
    n_questions, seed, T = int(n_questions), int(seed), T_ROUNDS
    sim = _simulate(prof, n_questions, seed, T)
    arrays = empty_arrays(n_questions, T, n_exit=2, n_llm_policy=2)
    arrays["round_mask"][:] = True
    for k in (
        "base_answer", "base_correct", "base_tokens_in", "base_tokens_out", "base_confidence",
        "guide_verdict", "guide_answer", "guide_correct", "guide_tokens_in", "guide_tokens_out",
        "guide_uncertainty", "exit_correct", "exit_rounds", "exit_cost_cents", "llm_policy_actions",
    ):
        arrays[k] = sim[k].astype(arrays[k].dtype)
    # Renumber answers in order of first appearance (base r1, guide r1, base r2, ...), as
    # envs.cache.jsonl numbers them, so that a JSONL export + import keeps the checksum. The
    # text keeps the generator's random label: "synthetic answer <label>".
    seq = np.stack([sim["base_answer"], sim["guide_answer"]], axis=2).reshape(n_questions, 2 * T)
    same = seq[:, :, None] == seq[:, None, :]  # [Q, 2T, 2T]
    first_pos = np.argmax(same, axis=2)  # first position holding the same label
    is_first = first_pos == np.arange(2 * T)[None, :]
    new_id = (np.cumsum(is_first, axis=1) - 1)[np.arange(n_questions)[:, None], first_pos].astype(np.int32)
    arrays["base_answer"], arrays["guide_answer"] = new_id[:, 0::2].copy(), new_id[:, 1::2].copy()
    texts = np.array([f"synthetic answer {j}" for j in range(2 * T)])
    labels = texts[seq]
    answer_text = np.full((n_questions, 2 * T), "", dtype=texts.dtype)
    q_idx, pos = np.nonzero(is_first)
    answer_text[q_idx, new_id[q_idx, pos]] = labels[q_idx, pos]
    arrays["answer_text"] = answer_text
    arrays["gold"] = texts[sim["perm"][:, 0]]
    arrays["question_ids"] = np.char.add(f"syn-{prof.name}-s{seed}-q", np.arange(n_questions).astype(str))
    arrays["exit_mask"][:] = True
    manifest = Manifest(
        name=f"synthetic-{prof.name}-s{seed}",
        task=prof.task,
        T=T,
        base=ModelInfo(prof.base_model, 0.0, 0.0),
        guide=GUIDE,
        provenance={
            "kind": "synthetic",
            "generator": f"envs.synthetic/{prof.name}",
            "seed": seed,
            "calibrated_to": f"{PAPER} {prof.table}",
            "note": "generated by a calibrated model, not LLM outputs",
        },
        exit_models=prof.models,
        llm_policy_models=prof.models,
    )
    return ResponseCache(manifest, arrays).with_checksum()


# ---------------------------------------------------------------------------
# calibration (developer tool; the fitted numbers are written into PROFILES)


def _bisect(f: Callable[[float], float], target: float, lo: float, hi: float, iters: int = 30) -> float:
    """x in [lo, hi] with f(x) ~ target for an increasing f (clipped at the ends)."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def calibrate(profile: str | Profile, n: int = 50_000, seed: int = 20251114, cycles: int = 3) -> Profile:
    """Refit the free parameters of ``profile`` to its targets on ``n`` questions.

    Cyclic one-dimensional bisections (each marginal is monotone in its
    parameter): chain (mu_b -> Random coverage, mu_g -> guide round-1 coverage,
    s -> unsolvable share), question tokens -> cents per guide call, EXIT
    offsets -> coverage and length, per-round EXIT cost -> cost, LLM-policy
    n0 -> length and skill -> coverage. Returns the profile with the new
    parameters and with each target's ``sd`` re-measured.
    """
    prof = get_profile(profile)
    tg = {k: v.value for k, v in prof.targets.items()}

    def m(p: Profile) -> dict[str, float]:
        return measure(_cache_from(p, n, seed))

    def with_chain(p: Profile, **kw) -> Profile:
        return dataclasses.replace(p, chain=dataclasses.replace(p.chain, **kw))

    for _ in range(cycles):
        prof = with_chain(prof, mu_b=_bisect(lambda x: m(with_chain(prof, mu_b=x))["random_coverage"], tg["random_coverage"], -4, 3, 22))
        prof = with_chain(prof, mu_g=_bisect(lambda x: m(with_chain(prof, mu_g=x))["guide_round1_coverage"], tg["guide_round1_coverage"], -2, 5, 22))
        prof = with_chain(prof, s=_bisect(lambda x: m(with_chain(prof, s=x))["unsolvable"], tg["unsolvable"], 0.05, 6, 22))
    tok = lambda x: dataclasses.replace(prof, tokens=dataclasses.replace(prof.tokens, q_tokens=x))  # noqa: E731
    prof = tok(_bisect(lambda x: m(tok(x))["cents_per_guide_call"], tg["cents_per_guide_call"], 1, 400, 25))
    for key, attr in (("gpt4o", "exit_gpt4o"), ("base", "exit_base")):
        ex = lambda **kw: dataclasses.replace(prof, **{attr: dataclasses.replace(getattr(prof, attr), **kw)})  # noqa: E731
        for _ in range(2):
            prof = ex(e0=_bisect(lambda x: m(ex(e0=x))[f"{key}_exit_coverage"], tg[f"{key}_exit_coverage"], -5, 6, 22))
            top = tg[f"{key}_exit_len"] >= T_ROUNDS - 1e-9
            prof = ex(c0=12.0 if top else _bisect(lambda x: m(ex(c0=x))[f"{key}_exit_len"], tg[f"{key}_exit_len"], -6, 8, 22))
        cost_key = f"{key}_exit_cost_per_200"
        if cost_key in tg:
            got = m(prof)[f"{key}_exit_len"]
            prof = ex(cost_round=tg[cost_key] / 200.0 / got)
    for key, attr in (("gpt4o", "policy_gpt4o"), ("base", "policy_base")):
        po = lambda **kw: dataclasses.replace(prof, **{attr: dataclasses.replace(getattr(prof, attr), **kw)})  # noqa: E731
        for _ in range(3):
            prof = po(n0=_bisect(lambda x: m(po(n0=x))[f"{key}_policy_len"], tg[f"{key}_policy_len"], -8, 3, 22))
            prof = po(skill=_bisect(lambda x: m(po(skill=x))[f"{key}_policy_coverage"], tg[f"{key}_policy_coverage"], -1, 1, 20))
    vals = per_question_marginals(_cache_from(prof, n, seed))
    targets = {k: dataclasses.replace(v, sd=round(float(vals[k].std()), 4)) for k, v in prof.targets.items()}
    return dataclasses.replace(prof, targets=targets)


def _cache_from(p: Profile, n: int, seed: int) -> ResponseCache:
    """A cache with only the arrays :func:`measure` reads (no texts, no checksum): fast fits."""
    sim = _simulate(p, n, seed)
    sim["round_mask"] = np.ones_like(sim["base_correct"])
    man = Manifest(f"calibration-{p.name}", p.task, T_ROUNDS, ModelInfo(p.base_model), GUIDE,
                   {"kind": "synthetic"}, exit_models=p.models, llm_policy_models=p.models)
    return ResponseCache(man, sim)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m envs.generators.synthetic", description="measure or refit the SYNTHETIC profiles")
    ap.add_argument("--calibrate", nargs="*", metavar="PROFILE", help="refit these profiles (default: all) and print the parameters")
    ap.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.calibrate is not None:
        for name in args.calibrate or list(PROFILES):
            p = calibrate(name)
            print(f"# {name}")
            for part in ("chain", "tokens", "exit_gpt4o", "exit_base", "policy_gpt4o", "policy_base"):
                print(f"{part} = {getattr(p, part)!r}")
            print("sds =", {k: v.sd for k, v in p.targets.items()})
        return
    print(f"SYNTHETIC caches, {args.questions} questions, seed {args.seed}")
    for name, prof in PROFILES.items():
        cache = generate(name, args.questions, args.seed)
        got = measure(cache)
        n = args.questions
        print(f"\n### {name} ({PAPER} {prof.table}; base {prof.base_model}, guide gpt-4o)\n")
        print("| marginal | target | measured | tolerance | within | target source |")
        print("|---|---|---|---|---|---|")
        for k, tgt in prof.targets.items():
            ok = abs(got[k] - tgt.value) <= tgt.tol(n)
            print(f"| {k} | {tgt.value:.4g} | {got[k]:.4g} | {tgt.tol(n):.3g} | {'yes' if ok else 'NO'} | {tgt.source} |")
        acc = ", ".join(f"{x:.3f}" for x in base_accuracy_by_round(cache))
        print(f"\nnot targets: base accuracy by round {acc}; Random length {got['random_len']:.3f}")


if __name__ == "__main__":
    _main()
