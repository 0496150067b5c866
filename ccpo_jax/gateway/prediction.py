"""The deployed router's own replay prediction: the exported router walked over its training cache.

``live-eval`` compares what a deployed router realises live with what replay predicts. The training
run's results.json holds a row's MEAN over splits x seeds, each recalibrated with its own threshold;
the exported router is one policy with one threshold (kappa), so its own prediction is its replay on
the cache it was trained on: :func:`router_replay` runs every cache question through the gateway's
semantics (:func:`ccpo_jax.gateway.engine.run_protocol`) with the cached rounds in place of upstream
calls:

* round t (0-based) is charged when it is run, at the prices the gateway charges for round t
  (:func:`~ccpo_jax.gateway.engine.per_round`, :func:`~ccpo_jax.gateway.engine.cents`, the cache's
  tokens of each role);
* after it the router decides on ``rounds[:t+1]`` with ``can_continue = t+1 < T`` (and the question's
  own ``group``: a Mondrian router's threshold), screened as the gateway decides
  (``Router.decide_many(screen=True)``); the roles in the set are collected; the question stops when
  "next" is not in the set (at the last round it is not available, so every question stops by T);
* matched coverage (the paper's, the one the router is calibrated for, paper Eq. 1): an answer of the
  set is correct, or the question is unsolvable (no answer of any of its T cached rounds is correct);
  ``set``: an answer of the set is correct (unsolvable questions missed), and ``set or none seen``:
  also counting questions none of whose rounds run had a correct answer: the two counts live-eval
  can see, which bracket the matched coverage.

A cache question with fewer rounds than T (a journal's) may continue only while it has a next cached
round (``can_continue = t+1 < len(rounds)``, as ``ccpo-jax route --every-round`` and the replay
environment); a training cache has T rounds for every question, where the two rules agree.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest

from ccpo_jax.errors import UserError
from ccpo_jax.gateway.engine import Prices, cents, per_round
from ccpo_jax.serving import Router

ROLES = ("base", "guide")


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95% interval of a binomial proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


def _replay_rows(router: Router, records: list[dict], prices: Prices) -> list[dict]:
    """Per question: rounds run, cost (cents), set covered, unsolvable, none seen, empty set."""
    roles = ROLES if router.has_guide else ("base",)
    n = len(records)
    cost = np.zeros(n)
    ran = np.zeros(n, int)
    got = [[] for _ in range(n)]  # the correct flags of the answers collected
    active = list(range(n))
    for t in range(router.T):
        active = [i for i in active if t < len(records[i]["rounds"])]
        if not active:
            break
        for i in active:
            rd = records[i]["rounds"][t]
            cost[i] += sum(cents(prices[r][t], rd[r]["tokens_in"], rd[r]["tokens_out"]) for r in roles)
            ran[i] = t + 1
        reqs = [{"rounds": records[i]["rounds"][: t + 1], "group": records[i].get("group"),
                 "can_continue": t + 1 < min(router.T, len(records[i]["rounds"]))} for i in active]
        ds = router.decide_many(reqs, screen=True)
        nxt = []
        for i, d in zip(active, ds):
            rd = records[i]["rounds"][t]
            got[i] += [bool(rd[r]["correct"]) for r in roles if r in d["action_set"]]
            if d["continue"]:
                nxt.append(i)
        active = nxt
    rows = []
    for i, rec in enumerate(records):
        rs = rec["rounds"]
        rows.append({"rounds": int(ran[i]), "cost_cents": float(cost[i]), "set": any(got[i]),
                     "unsolvable": not any(rd[r]["correct"] for rd in rs for r in roles),
                     "none_seen": not any(rd[r]["correct"] for rd in rs[: ran[i]] for r in roles),
                     "empty_set": not got[i]})
    return rows


def router_replay(router: Router, cache: Any, prices: dict | None = None) -> dict:
    """The router's own prediction: its replay over every question of ``cache`` (a path of either cache
    format, or a ResponseCache), at ``prices`` (per role one (in, out) pair or T of them, USD per M tokens;
    default: the router's trained prices, which the gateway charges unless ``--price`` is given).

    Returns the means over the cache's questions: ``rounds_mean``, ``cost_cents_per_question``,
    ``coverage`` (matched) with its Clopper-Pearson 95% interval ``coverage_ci95``, ``coverage_set``,
    ``coverage_set_or_none_seen``, ``empty_set_share``, ``unsolvable_share``, and ``questions``."""
    from envs.cache.formats import load_cache
    from envs.cache.jsonl import cache_to_records

    c = cache if not isinstance(cache, (str, Path)) else load_cache(cache)
    if prices is None:
        from ccpo_jax.gateway.service import _rung_prices

        m = router.manifest["models"]
        prices = {r: _rung_prices(m[r], router.T) for r in ROLES}
    rows = _replay_rows(router, cache_to_records(c), per_round(prices, router.T))
    n = len(rows)
    mean = lambda key: float(np.mean([r[key] for r in rows])) if n else None  # noqa: E731
    k = sum(r["set"] or r["unsolvable"] for r in rows)
    return {"questions": n, "rounds_mean": mean("rounds"), "cost_cents_per_question": mean("cost_cents"),
            "coverage": k / n if n else None, "coverage_ci95": clopper_pearson(k, n),
            "coverage_set": mean("set"),
            "coverage_set_or_none_seen": float(np.mean([r["set"] or r["none_seen"] for r in rows])) if n else None,
            "empty_set_share": mean("empty_set"), "unsolvable_share": mean("unsolvable"),
            "cache": c.manifest.name, "cache_checksum": c.manifest.checksum}


# -- which cache ------------------------------------------------------------------------------

def _trained_on(manifest: dict) -> dict:
    return manifest.get("cache") or {}


def check_cache(router: Router, cache, where: str) -> None:
    """``cache`` must be the one the router was trained on (its checksum, else its name and T)."""
    want = _trained_on(router.manifest)
    got_sum, want_sum = cache.manifest.checksum, want.get("checksum")
    if want_sum and got_sum != want_sum:
        raise UserError(f"{where}: not the cache the router was trained on (checksum {got_sum}; the artefact's "
                        f"cache {want.get('name')!r} has {want_sum})", field="cache")
    if cache.manifest.T != router.T:
        raise UserError(f"{where}: T = {cache.manifest.T} rounds, the router's T = {router.T}", field="cache")


def find_cache(router: Router, given: str | None) -> tuple[Any, str]:
    """(the training cache or None, a line saying where it came from or why the prediction is skipped).

    ``given`` (``--cache``): loaded and checked, a missing or mismatched file is a UserError. Else the
    training run's run.json beside the artefact's policy directory (``source.policy_dir``) names it: a
    path, or None for the setting's built-in SYNTHETIC cache (regenerated); checked the same way, and
    when it is not there or does not match, the prediction is skipped with the reason."""
    from envs.cache.formats import load_cache
    from envs.cache.schema import CacheError

    if given is not None:
        try:
            c = load_cache(given)
        except (CacheError, OSError, ValueError) as e:
            raise UserError(f"{given}: cannot read the cache ({e})", field="cache") from None
        check_cache(router, c, str(given))
        return c, f"--cache {given}"
    skip = "the router's own replay prediction skipped: "
    pdir = router.manifest.get("source", {}).get("policy_dir")
    run_file = Path(pdir).parent.parent / "run.json" if pdir else None
    if run_file is None or not run_file.is_file():
        return None, skip + "no run.json of the training run found (pass --cache)"
    path = None
    try:
        run = json.loads(run_file.read_text())
        path = run.get("cache")
        if path is None:
            from ccpo_jax.ccpo.prepare import load_run_cache
            from ccpo_jax.ccpo.settings import get_setting

            c, what = load_run_cache(get_setting(run["setting"]), None), f"setting {run['setting']}'s built-in cache"
        else:
            c, what = load_cache(path), str(path)
        check_cache(router, c, what)
    except (UserError, CacheError, OSError, ValueError, KeyError, TypeError) as e:
        return None, skip + f"{run_file}: its cache {path or '(built-in)'} ({e}); pass --cache"
    return c, f"{what} (from {run_file})"
