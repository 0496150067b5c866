"""The best observable reference: the cheapest stopping policy that sees only the observations
(issue 40; docs/results.md, "Best observable").

The clairvoyant bound (``envs.replay.bound``) knows every answer, so no router can reach it. This
reference is as optimistic in how it is found (its thresholds are chosen with the labels of
each test split, in-sample) but it cannot see answers: it acts on a correctness model of the
router's own observation ``o_t`` (``envs.replay.features``, the rows of ``EnvParams.obs``).

**The policy family.** At every reached round it collects the base and the guide answer (a
set's cost is the rounds it runs, so collecting costs nothing and can only cover more), and it
goes on past round t iff ``s_t(o_t) < tau_t`` (and round t+1 exists), where

    s_t(o_t) = P(covered by rounds 1..t | o_t)

(covered: a collected answer is right, or the question is unsolvable, as in
``envs.replay.env.evaluate_sets``). With every answer collected, going on from round t can
only help a question not covered yet, so stopping the likeliest-covered first is the natural
order; where the score is flat over observations that differ, ties are broken by the
observation itself (:func:`order_keys`), as the oracle's thresholds on a raw signal do, and
identical observations are never split. Equal to the brute-force best observable policy of
every oracle cache (``envs.generators.oracle.best_observable``) within 0.7 % at n = 4000
(tests/ccpo/test_best_observable.py asserts 2 %).

**The scores.** No closed form is used, for any cache. The synthetic generator's latent
per-question probabilities (``envs.generators.synthetic``: a continuous difficulty d_q, whether the guide
knows, the base's adopt/repeat history, noise in the uncertainty and tokens) are not determined
by what the policy observes, so the posterior is an integral over them; the oracle caches'
posteriors are known per class but the fitted form already meets them within 2 %. Every cache
gets the fitted form (:func:`fit_scores`): per round, a histogram gradient-boosting classifier
and an L2-regularised logistic regression on the router's observation ``o_t``, each
question's score out of fold (3-fold cross-fitting: a model that never saw its labels, one fit
for every split); per round the model with the lower held-out log loss is used.

**The thresholds.** Per test split, ``tau_1 .. tau_{T-1}`` minimise the split's total cost at
coverage >= 1 - alpha (``envs.replay.bound.required_covered``), in-sample: a Lagrangian coordinate
search over every cut of the split's own scores, then constrained coordinate passes from two
starts in both round orders (:func:`choose_thresholds`; equal to the brute force over every cut
on random problems, tests/ccpo/test_best_observable.py). Row metrics as ``evaluate_sets`` gives them.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ccpo_jax.ccpo.rowid import BEST_OBSERVABLE
from envs.replay.bound import required_covered

#: Row name in results.json and table.md (not a policy: its thresholds see the test labels).
BEST_OBS_ROW = BEST_OBSERVABLE.name
#: Cross-fitting folds: each question's score comes from a model fitted on the other folds.
FOLDS = 3
_LAMBDA_STEPS = 20  # bisection steps on the Lagrange multiplier (log scale)
_PASSES = 2  # coordinate passes per multiplier


# -- the correctness model ------------------------------------------------------------------

def covered_by(params) -> np.ndarray:
    """[Q, T] bool: a base or guide answer of rounds 1..t is right, or the question is unsolvable."""
    right = (np.asarray(params.base_correct) | np.asarray(params.guide_correct)) & np.asarray(params.round_mask)
    return np.logical_or.accumulate(right, axis=1) | np.asarray(params.unsolvable)[:, None]


def _models():
    from sklearn.ensemble import HistGradientBoostingClassifier  # sklearn is slow to import: only when used
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return {
        "HistGradientBoostingClassifier": lambda: HistGradientBoostingClassifier(
            max_iter=60, learning_rate=0.15, max_leaf_nodes=15, min_samples_leaf=20, l2_regularization=1.0,
            random_state=0),
        "LogisticRegression (L2, C=1)": lambda: make_pipeline(StandardScaler(), LogisticRegression(C=1.0,
                                                                                                max_iter=500)),
    }


def _log_loss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(np.where(y, np.log(p), np.log1p(-p))))


def fit_scores(params, folds: int = FOLDS, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """:func:`_fit_scores` on one thread: scikit-learn's OpenMP threads fight the trainer's and
    other processes' on a shared machine (a fit took many times longer there;
    docs/performance.md#figures-behind-code-comments), and one thread gives the same numbers on any machine."""
    t0 = time.perf_counter()  # fit_s counts importing scikit-learn: the row's whole price
    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    models = _models()  # imports scikit-learn first: the limit applies only to libraries loaded
    with threadpool_limits(1):
        scores, info = _fit_scores(params, models, folds, seed)
    return scores, dict(info, fit_s=time.perf_counter() - t0)


def _fit_scores(params, models: dict, folds: int, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """[Q, T] out-of-fold scores ``P(covered by rounds 1..t | o_t)`` and what was fitted:
    ``{"form", "models": [per round], "log_loss": [per round {model: loss}], "folds"}``, for the
    rounds with a decision (1..T-1; the last round always stops, its scores and padding rounds'
    are NaN). A round whose labels are all equal (e.g. every question covered) gets that constant."""
    obs = np.asarray(params.obs, np.float64)
    mask = np.asarray(params.round_mask)
    y_all = covered_by(params)
    Q, T = mask.shape
    fold = np.random.default_rng(seed).permutation(Q) % folds
    scores = np.full((Q, T), np.nan)
    chosen, losses = [], []
    for t in range(T - 1):
        rows = np.flatnonzero(mask[:, t])
        x, y = obs[rows, t], y_all[rows, t]
        if y.all() or not y.any():
            scores[rows, t] = float(y.all())
            chosen.append("constant")
            losses.append({})
            continue
        oof = {}
        for name, make in models.items():
            p = np.full(rows.size, y.mean())
            for k in range(folds):
                tr, te = fold[rows] != k, fold[rows] == k
                if not te.any():
                    continue
                if y[tr].all() or not y[tr].any():
                    p[te] = float(y[tr].mean()) if tr.any() else y.mean()
                    continue
                p[te] = make().fit(x[tr], y[tr]).predict_proba(x[te])[:, 1]
            oof[name] = p
        loss = {name: _log_loss(y, p) for name, p in oof.items()}
        best = min(loss, key=loss.get)
        # equal observations, equal scores (their mean): the folds' models differ a little, and a
        # policy of o_t must not split a set of identical observations by fold
        _, group = np.unique(x, axis=0, return_inverse=True)
        group = group.reshape(-1)
        scores[rows, t] = (np.bincount(group, oof[best]) / np.bincount(group))[group]
        chosen.append(best)
        losses.append(loss)
    used = sorted({c for c in chosen if c != "constant"})
    form = "fitted: " + (" / ".join(used) if used else "constant")
    info = {"form": form if T > 1 else "none: one round, no decision to make",
            "models": chosen, "log_loss": losses, "folds": folds}
    return scores, info


def order_keys(scores: np.ndarray, obs) -> np.ndarray:
    """[Q, T] keys of the stopping order: the scores' order, ties between different observations
    broken by the observation (lexicographically), equal observations tied (NaN on padding).

    Thresholds on these keys are the deterministic policies of o_t that stop the higher scores:
    where the score is flat over observations that differ (a band of a signal with a constant
    posterior), a threshold may still cut between them, as the oracle's thresholds on the raw
    signal do (``envs.generators.oracle.best_observable``)."""
    obs = np.asarray(obs, np.float64)
    keys = np.full(scores.shape, np.nan)
    for t in range(scores.shape[1]):
        rows = np.flatnonzero(np.isfinite(scores[:, t]))
        if rows.size == 0:
            continue
        _, o_rank = np.unique(obs[rows, t], axis=0, return_inverse=True)
        s = scores[rows, t]
        order = np.lexsort((o_rank.reshape(-1), s))
        pair = np.stack([s[order], o_rank.reshape(-1)[order]], -1)
        new = np.concatenate([[True], np.any(pair[1:] != pair[:-1], axis=-1)])
        keys[rows[order], t] = np.cumsum(new) - 1.0
    return keys


# -- the thresholds -------------------------------------------------------------------------

def _tail(s, stop_tau, nxt, cum, cov):
    """Backward pass: (cost, covered) [S, n, T] of a question that has reached round t and then
    follows the thresholds ``stop_tau`` [S, T-1] (stop iff s_t >= tau_t or no round t+1)."""
    T = s.shape[-1]
    C, V = np.empty_like(cum), np.empty_like(cov)
    C[..., T - 1], V[..., T - 1] = cum[..., T - 1], cov[..., T - 1]
    for t in range(T - 2, -1, -1):
        stop = (s[..., t] >= stop_tau[:, t:t + 1]) | ~nxt[..., t]
        C[..., t] = np.where(stop, cum[..., t], C[..., t + 1])
        V[..., t] = np.where(stop, cov[..., t], V[..., t + 1])
    return C, V


def _reach(s, tau, nxt):
    """[S, n, T] bool: round t is reached under the thresholds."""
    go = (s[..., :-1] < tau[:, None, :]) & nxt[..., :-1]
    first = np.ones(s.shape[:-1] + (1,), bool)
    return np.concatenate([first, np.logical_and.accumulate(go, axis=-1)], axis=-1)


def _coordinate(r, s, tau, nxt, cum, cov, lam=None, need=None):
    """Best tau_r [S] with the others fixed: minimise cost - lam * covered (``lam`` [S]) or, with
    ``need`` [S], the cheapest cut with covered >= need (keeping tau_r where none is)."""
    C, V = _tail(s, tau, nxt, cum, cov)
    elig = _reach(s, tau, nxt)[..., r] & nxt[..., r]
    fixed_c = np.where(elig, C[..., r + 1], C[..., 0]).sum(-1)  # everyone eligible goes on
    fixed_v = np.where(elig, V[..., r + 1], V[..., 0]).sum(-1)
    d_c = np.where(elig, cum[..., r] - C[..., r + 1], 0.0)  # change when an eligible one stops
    d_v = np.where(elig, cov[..., r].astype(float) - V[..., r + 1], 0.0)
    key = np.where(elig, s[..., r], -np.inf)
    order = np.argsort(-key, axis=-1, kind="stable")
    ks = np.take_along_axis(key, order, -1)
    zero = np.zeros(ks.shape[:-1] + (1,))
    cost = fixed_c[:, None] + np.concatenate([zero, np.cumsum(np.take_along_axis(d_c, order, -1), -1)], -1)
    covd = fixed_v[:, None] + np.concatenate([zero, np.cumsum(np.take_along_axis(d_v, order, -1), -1)], -1)
    # a cut after k questions is a threshold only between two distinct eligible scores
    ok = np.concatenate([np.ones_like(zero, bool),
                         np.isfinite(ks) & np.concatenate([ks[..., :-1] > ks[..., 1:], np.ones_like(zero, bool)], -1)],
                        -1)
    if need is not None:
        obj = np.where(ok & (covd >= need[:, None] - 1e-9), cost, np.inf)
    else:
        obj = np.where(ok, cost - lam[:, None] * covd, np.inf)
    k = np.argmin(obj, axis=-1)
    new = np.where(k == 0, np.inf, np.take_along_axis(np.concatenate([ks, zero], -1), np.maximum(k - 1, 0)[:, None],
                                                      -1)[:, 0])
    if need is not None:
        new = np.where(np.isfinite(obj.min(-1)), new, tau[:, r])
    out = tau.copy()
    out[:, r] = new
    return out


def _totals(s, tau, nxt, cum, cov):
    C, V = _tail(s, tau, nxt, cum, cov)
    return C[..., 0].sum(-1), V[..., 0].sum(-1)


def choose_thresholds(scores, cost, covered, nxt, alpha: float) -> np.ndarray:
    """tau [S, T-1]: per split, the cheapest thresholds with coverage >= 1 - alpha, in-sample.

    ``scores``, ``cost`` (cents of each round, 0 on padding), ``covered`` (covered by rounds 1..t)
    and ``nxt`` (round t+1 exists) are [S, n, T]. Stop at round t iff score >= tau_t; +inf =
    always go on (covers every solvable question, so some choice is always feasible)."""
    s = np.where(np.isfinite(scores), scores, np.inf)  # padding rounds: never reached
    cum = np.cumsum(np.asarray(cost, np.float64), -1)
    cov = np.asarray(covered, bool)
    nxt = np.asarray(nxt, bool)
    S, n, T = s.shape
    need = np.full(S, float(required_covered(n, alpha)))
    tau = np.full((S, max(T - 1, 0)), np.inf)
    if T == 1:
        return tau
    best_c, _ = _totals(s, tau, nxt, cum, cov)
    best = tau.copy()
    # the multiplier that makes one more covered question worth its dearest possible price
    lo, hi = np.full(S, 1e-6 * cum[..., -1].mean()), np.full(S, 10.0 * cum[..., -1].max(-1).max())
    for _ in range(_LAMBDA_STEPS):
        lam = np.sqrt(lo * hi)
        t_l = best.copy()
        for _ in range(_PASSES):
            for r in range(T - 2, -1, -1):
                t_l = _coordinate(r, s, t_l, nxt, cum, cov, lam=lam)
        c, v = _totals(s, t_l, nxt, cum, cov)
        feas = v >= need - 1e-9
        better = feas & (c < best_c - 1e-12)
        best[better], best_c[better] = t_l[better], c[better]
        hi, lo = np.where(feas, lam, hi), np.where(feas, lo, lam)
    # Constrained passes spend what the multiplier's convex hull leaves of the slack. Which round
    # spends it first matters (a flat band of scores at round 1 against a cheaper cut at round 2),
    # so they start from the multiplier's best and from "always go on", in both round orders.
    out, out_c = best.copy(), best_c.copy()
    for start in (best, np.full_like(best, np.inf)):
        for rounds in (range(T - 2, -1, -1), range(T - 1)):
            t_c = start.copy()
            for _ in range(_PASSES):
                for r in rounds:
                    t_c = _coordinate(r, s, t_c, nxt, cum, cov, need=need)
            c, v = _totals(s, t_c, nxt, cum, cov)
            better = (v >= need - 1e-9) & (c < out_c - 1e-12)
            out[better], out_c[better] = t_c[better], c[better]
    return out


def stop_sets(scores, tau, available) -> np.ndarray:
    """[S, n, T, 3] action sets: base and guide at every round, next iff score < tau_t."""
    s = np.where(np.isfinite(scores), scores, np.inf)  # padding rounds: never reached
    avail = np.asarray(available, bool)
    go = np.zeros(s.shape, bool)
    go[..., :-1] = s[..., :-1] < tau[:, None, :]
    return np.stack([avail[..., 0], avail[..., 1], go & avail[..., 2]], -1)


def _metrics(params, idx, reach) -> dict[str, np.ndarray]:
    """Row metrics [S] of the sets that collect both answers of every reached round ``reach``
    [S, n, T]: the sums and means of ``envs.replay.env.evaluate_sets`` (tests check they are
    equal), in NumPy (jitting the env's rollout for one more shape costs more than this row)."""
    mask = np.asarray(params.round_mask)[idx]
    reach = reach & mask
    cost = np.where(reach, np.asarray(params.cost, np.float64)[idx], 0.0).sum(-1)
    right = (np.asarray(params.base_correct) | np.asarray(params.guide_correct))[idx]
    covered = (reach & right).any(-1) | np.asarray(params.unsolvable)[idx]
    ids = np.stack([np.asarray(params.base_answer)[idx], np.asarray(params.guide_answer)[idx]], -1)
    took = np.repeat(reach, 2, axis=-1)
    ids = ids.reshape(took.shape).astype(np.int64)
    took &= ids >= 0  # a guide-less cascade's guide slot holds no answer (-1)
    ids = np.sort(np.where(took, ids, np.iinfo(np.int64).max), -1)
    new = np.concatenate([took[..., :1].any(-1, keepdims=True), ids[..., 1:] != ids[..., :-1]], -1)
    size = (new & (ids != np.iinfo(np.int64).max)).sum(-1)
    return {"cost_cents": cost.sum(-1), "coverage": covered.mean(-1), "avg_len": reach.sum(-1).mean(-1),
            "set_size": size.mean(-1)}


def best_observable_row(params, test_idx, alpha: float, scores: np.ndarray | None = None,
                        info: dict | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The reference on every test split ``test_idx`` [S, n]: the row's metrics [S] (cost summed
    over the split, coverage, avg. length, set size, as ``envs.replay.env.evaluate_sets`` gives
    them) and what was fitted (:func:`fit_scores`, plus ``search_s``, the threshold search's
    seconds). ``scores``/``info``: reuse a fit (e.g.
    across the alphas of a sweep)."""
    if scores is None:
        scores, info = fit_scores(params)
    t0 = time.perf_counter()
    idx = np.atleast_2d(np.asarray(test_idx))
    cost = np.where(np.asarray(params.round_mask), np.asarray(params.cost, np.float64), 0.0)[idx]
    nxt = np.asarray(params.available)[idx][..., 2]
    keys = order_keys(scores, params.obs)[idx]
    tau = choose_thresholds(keys, cost, covered_by(params)[idx], nxt, alpha)
    row = _metrics(params, idx, _reach(np.where(np.isfinite(keys), keys, np.inf), tau, nxt))
    info = dict(info or {}, search_s=time.perf_counter() - t0)
    return row, info


# -- results.json -----------------------------------------------------------------------------

def describe(info: dict[str, Any]) -> dict[str, Any]:
    """The keys the reference's row carries in results.json besides its metrics: ``form`` and how
    it was fitted (JSON-ready; no times, so a resumed run's row equals an uninterrupted one's:
    :func:`seconds` goes to the ``timing`` block)."""
    return {"form": str(info.get("form", "?")), "models": list(info.get("models", [])),
            "held_out_log_loss": [{k: round(float(v), 5) for k, v in d.items()} for d in info.get("log_loss", [])],
            "folds": int(info.get("folds", FOLDS))}


def seconds(info: dict[str, Any]) -> float:
    """The reference's cost in wall time: the model fit plus the threshold search."""
    return float(info.get("fit_s", 0.0)) + float(info.get("search_s", 0.0))


def add_cost_over_best_observable(policies: dict[str, dict[str, Any]], bound_row: str) -> None:
    """Mark the reference's row (``is_policy: false``) and give every policy row its
    ``cost_over_best_observable`` (shaped as ``cost_vs_bound``: the row's mean cost over the
    reference's mean over the same splits, per training seed, and their mean). Nothing when
    there is no reference row."""
    if BEST_OBS_ROW not in policies:
        return
    policies[BEST_OBS_ROW]["is_policy"] = False
    ref = policies[BEST_OBS_ROW]["cost_cents"]["mean"]
    for name, entry in policies.items():
        if name in (BEST_OBS_ROW, bound_row):
            continue
        per_seed = [None if (x is None or not ref) else x / ref for x in entry["per_seed"]["cost_cents"]]
        finite = [x for x in per_seed if x is not None]
        entry["cost_over_best_observable"] = {"mean": float(np.mean(finite)) if finite else None,
                                              "per_seed": per_seed}
