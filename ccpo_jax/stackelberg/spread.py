"""Seed spread of the Stackelberg evaluation: the same pipeline run under several ``--seed`` values, one
row per strategy (and reference row) with the mean and range over seeds and the change against
Conservative on each seed, and whether its sign agrees on every seed (issue 28: a headline whose sign
flips between seeds is not a result)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from envs.cache.atomic import atomic_write_text

from .evaluate import BASELINE


def seed_spread(results: list[dict], size: str = "large") -> dict:
    """``results``: the results.json dicts of runs that differ only in their seed. -> name -> summary."""
    if not results:
        raise ValueError("seed_spread needs at least one run")
    evs = [r["evaluation"][size] for r in results]
    rows = lambda ev: {**ev["strategies"], **ev.get("reference", {})}  # noqa: E731
    out = {}
    for name in rows(evs[0]):
        rs = [rows(ev)[name] for ev in evs]
        t = np.array([r["tokens_per_turn"] for r in rs])
        q = np.array([r["quality"] for r in rs])
        d = np.array([r["token_change_vs_conservative"] for r in rs])
        out[name] = {
            "reference_row": name in evs[0].get("reference", {}),
            "tokens_per_turn": {"mean": float(t.mean()), "min": float(t.min()), "max": float(t.max()),
                                "sd": float(t.std(ddof=1)) if len(t) > 1 else 0.0},
            "quality": {"mean": float(q.mean()), "min": float(q.min()), "max": float(q.max())},
            "token_change_per_seed": d.tolist(),
            "p_tokens_per_seed": [r["p_tokens_vs_conservative"] for r in rs],
            "sign_stable": None if name == BASELINE else bool(np.all(d < 0) or np.all(d > 0)),
        }
    return out


def write_spread_table(path: Path, spread: dict, seeds: list[int], episodes: int, synthetic: bool,
                       synthetic_leader: str | None = None) -> None:
    """spread.md; ``synthetic_leader``: the name of a SYNTHETIC leader utility profile, if one was used."""
    tags = (", SYNTHETIC grid" if synthetic else "") + (f", SYNTHETIC leader profile '{synthetic_leader}'" if synthetic_leader else "")
    L = [f"# Seed spread over seeds {seeds} ({episodes} episodes each{tags})\n",
         "| Policy | Tok./turn mean (min-max, sd) | Q mean (min-max) | dTok vs Cons. per seed | same sign on every seed |",
         "|---|---|---|---|---|"]
    for n, s in spread.items():
        t, q = s["tokens_per_turn"], s["quality"]
        label = f"*{n}* (reference)" if s["reference_row"] else n
        L.append(f"| {label} | {t['mean']:.1f} ({t['min']:.1f}-{t['max']:.1f}, {t['sd']:.1f}) | {q['mean']:.3f} "
                 f"({q['min']:.3f}-{q['max']:.3f}) | " + " / ".join(f"{100 * d:+.1f}%" for d in s["token_change_per_seed"])
                 + f" | {'-' if s['sign_stable'] is None else 'yes' if s['sign_stable'] else 'no'} |")
    atomic_write_text(path, "\n".join(L) + "\n")
