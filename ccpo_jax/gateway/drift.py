"""Replay a stream of cached questions through the gateway's decision code, with feedback after each.

The gateway without HTTP: each question's cached rounds are revealed one at a
time to :class:`~ccpo_jax.gateway.engine.Decider` (the code the live gateway
decides with), the set-valued policy collects answers until "next" leaves the
set, and the outcome goes to :class:`~ccpo_jax.gateway.online.CoverageState`.
Covered is the paper's matched coverage, the one the router was calibrated for:
an answer of the set is correct, or the question is unsolvable (no answer of
any cached round is correct). A live gateway cannot see unsolvable questions
(it runs only the rounds it needs), so its ``gold`` feedback counts the set
alone (docs/gateway.md). Used by the drift scenario (experiments/gateway_drift.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ccpo_jax.gateway.engine import Decider
from ccpo_jax.gateway.online import CoverageState
from ccpo_jax.serving import Router


def replay(router: Router, records: Sequence[dict], eta: float | None, window: int = 200,
           alarm_p: float = 0.01) -> dict[str, np.ndarray]:
    """Per question: covered, rounds used, cost in cents, kappa used, alarm after its feedback."""
    cov = CoverageState(router.alpha, float(router.kappa), eta, window, alarm_p)
    dec = Decider(router, cov)
    m = router.manifest["models"]
    price = {r: (m[r]["price_in"], m[r]["price_out"]) for r in ("base", "guide")}
    out = {k: [] for k in ("covered", "rounds", "cost_cents", "kappa", "alarm")}
    for rec in records:
        rounds = rec["rounds"]
        got, cents = [], 0.0
        kappa = cov.kappa
        for t in range(len(rounds)):
            cents += sum((rounds[t][r]["tokens_in"] * price[r][0] + rounds[t][r]["tokens_out"] * price[r][1]) / 1e4
                         for r in ("base", "guide"))
            d = dec.decide(rounds[: t + 1], t + 1 < len(rounds), rec.get("group"))
            got += [rounds[t][a]["correct"] for a in ("base", "guide") if a in d["action_set"]]
            if not d["continue"]:
                break
        unsolvable = not any(r[a]["correct"] for r in rounds for a in ("base", "guide"))
        hit = any(got) or unsolvable
        cov.record(hit)
        for k, v in (("covered", hit), ("rounds", t + 1), ("cost_cents", cents), ("kappa", kappa),
                     ("alarm", cov.alarm)):
            out[k].append(v)
    return {k: np.asarray(v) for k, v in out.items()}
