"""The PyTorch peer of ``benchmarks/cpo_step.py``: the same CPO step written the way a PyTorch
implementation writes it (autograd, a double-backward Hessian-vector product of the KL, two
conjugate-gradient solves, a backtracking line search that stops at the first accepted step), on the
same problems, one problem at a time.

    python benchmarks/cpo_step_torch.py PROBLEMS.npz OUT.json [--repeats 20] [--threads 1]

Needs torch and NumPy only (run it with any python that has them; ``benchmarks/perf.py`` writes
``PROBLEMS.npz`` from the JAX problems and reads ``OUT.json``). The npz holds, for P problems, the
policy's four dense layers ``W0..W3`` ``[P, in, out]``, ``b0..b3`` ``[P, out]`` and the batch
(``obs`` ``[P, E, T, F]``, ``avail``, ``actions``, ``mask``, ``adv``, ``success``, ``unsolvable``) and the
step's constants (``kappa``, ``alpha``, ``delta``, ``cg_iters``, ``backtrack_steps``). Writes the median
seconds of one step on problem 0, the seconds of all P steps in a loop, and every problem's new
flat parameters and accepted backtrack index (so the caller checks the peer computes the same step).
Formulas: ``ccpo_jax.core.trust_region`` (module docstring), ``ccpo_jax.core.conformal``,
``ccpo_jax.core.constraint``; float32 like the JAX step.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

TINY, B_ZERO = 1e-12, 1e-8


def _forward(flat, shapes, obs):
    h, i = obs, 0
    layers = []
    for shp in shapes:
        n = int(np.prod(shp))
        layers.append(flat[i:i + n].view(*shp))
        i += n
    ws = layers
    for k in range(0, len(ws) - 2, 2):
        h = torch.tanh(h @ ws[k] + ws[k + 1])
    return h @ ws[-2] + ws[-1]


class Problem:
    """One CPO step's functions of the flat parameters (objective, constraint, KL) at theta_k."""

    def __init__(self, d: dict, p: int):
        self.shapes = []
        parts = []
        for k in range(4):
            W, b = d[f"W{k}"][p], d[f"b{k}"][p]
            self.shapes += [W.shape, b.shape]
            parts += [W.reshape(-1), b.reshape(-1)]
        self.theta = torch.from_numpy(np.concatenate(parts).astype(np.float32))
        t = lambda k: torch.from_numpy(np.asarray(d[k][p]))  # noqa: E731
        self.obs, self.avail, self.actions = t("obs").float(), t("avail").bool(), t("actions").long()
        self.mask, self.adv = t("mask").bool(), t("adv").float()
        self.success, self.unsolvable = t("success").float(), t("unsolvable").bool()
        self.kappa, self.alpha = float(d["kappa"]), float(d["alpha"])
        with torch.no_grad():
            self.old = self.logp(self.theta)
            self.behaviour = self.taken(torch.log(torch.clamp(self.probs(self.theta), min=1e-30)))
        self.n = max(int(self.mask.sum()), 1)
        rho = torch.exp(self.taken(self.old) - self.behaviour)
        w = torch.prod(torch.where(self.mask, rho, torch.ones_like(rho)), -1)
        J = torch.where(self.unsolvable, torch.ones_like(w), w * self.success).mean()
        self.c = float((1.0 - self.alpha) - J)

    def probs(self, flat):
        logits = torch.where(self.avail, _forward(flat, self.shapes, self.obs), torch.tensor(-1e9))
        return torch.where(self.avail, torch.softmax(logits, -1), torch.tensor(0.0))

    def logp(self, flat):
        p = self.probs(flat)
        z = torch.nn.functional.logsigmoid((p - self.kappa) / 0.01)
        use = self.avail | ~self.avail.any(-1, keepdim=True)
        lp = torch.log_softmax(torch.where(use, z, torch.tensor(-math.inf)), -1)
        return torch.where(use, lp, torch.tensor(-math.inf))

    def taken(self, lp):
        return torch.gather(lp, -1, self.actions[..., None])[..., 0]

    def objective(self, flat):
        ratio = torch.exp(self.taken(self.logp(flat)) - self.taken(self.old))
        return torch.where(self.mask, ratio * self.adv, torch.tensor(0.0)).sum() / self.n

    def constraint(self, flat):
        d = torch.where(self.mask, self.taken(self.logp(flat)) - self.behaviour, torch.tensor(0.0))
        per = torch.where(self.unsolvable, torch.tensor(1.0), torch.exp(d.sum(-1)) * self.success)
        return -per.mean()

    def kl(self, flat):
        new = self.logp(flat)
        fin_old = torch.isfinite(self.old)
        diff = torch.where(fin_old, self.old - torch.where(torch.isfinite(new), new, torch.tensor(0.0)),
                           torch.tensor(0.0))
        per = (torch.exp(self.old) * diff).sum(-1)
        return torch.where(self.mask, per, torch.tensor(0.0)).sum() / self.n


def conjugate_gradient(Av, b, iters):
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r @ r
    for _ in range(iters):
        Ap = Av(p)
        a = rr / (p @ Ap)
        x = x + a * p
        r = r - a * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x if bool(torch.isfinite(x).all()) else torch.zeros_like(x)


def direction(g, b, c, hvp, delta, cg_iters):
    """x of the local problem (the cases of ``ccpo_jax.core.trust_region``), with plain Python branches."""
    v, w = conjugate_gradient(hvp, g, cg_iters), conjugate_gradient(hvp, b, cg_iters)
    q, r, s = max(float(g @ v), 0.0), float(g @ w), float(b @ w)
    if float(b @ b) <= B_ZERO or s <= TINY or not math.isfinite(s):
        return (math.sqrt(2 * delta / max(q, TINY)) * v if q > TINY else 0 * v) if c < 0 else 0 * w, (4 if c < 0 else 0)
    A, B = max(q - r * r / s, TINY), 2 * delta - c * c / s
    if c < 0 and B < 0:
        return math.sqrt(2 * delta / max(q, TINY)) * v if q > TINY else 0 * v, 3
    if c >= 0 and B < 0:
        return -math.sqrt(2 * delta / s) * w, 0
    mid = 0.0 if c == 0 else max(-r / c, 0.0)
    inf = math.inf
    a_lo, a_hi, a_ok = (mid, inf, True) if c > 0 else ((0.0, mid, mid > 0) if c < 0 else (0.0, inf, r > 0))
    b_lo, b_hi, b_ok = (mid, inf, True) if c < 0 else ((0.0, mid, mid > 0) if c > 0 else (0.0, inf, r <= 0))
    Bp, qs = max(B, TINY), max(q, TINY)
    clip = lambda x, lo, hi: min(max(x, max(lo, TINY)), max(hi, TINY))  # noqa: E731
    lam_a, lam_b = clip(math.sqrt(A / Bp), a_lo, a_hi), clip(math.sqrt(qs / (2 * delta)), b_lo, b_hi)
    fa = -0.5 * (A / lam_a + Bp * lam_a) + r * c / s if a_ok else -inf
    fb = -0.5 * (qs / lam_b + 2 * delta * lam_b) if b_ok else -inf
    lam = max(lam_a if fa >= fb else lam_b, TINY)
    nu = max(lam * c + r, 0.0) / s
    return (v - nu * w) / lam, (2 if c < 0 else 1)


def cpo_step(pb: Problem, delta, cg_iters, steps, decay=0.8, damping=1e-5, kl_slack=1.5, tol=1e-6):
    theta = pb.theta.clone().requires_grad_(True)
    obj0 = pb.objective(theta)
    g = torch.autograd.grad(obj0, theta)[0]
    con0 = pb.constraint(theta)
    b = torch.autograd.grad(con0, theta)[0]
    kl_grad = torch.autograd.grad(pb.kl(theta), theta, create_graph=True)[0]

    def hvp(u):
        return torch.autograd.grad(kl_grad @ u, theta, retain_graph=True)[0] + damping * u

    x, case = direction(g, b, pb.c, hvp, delta, cg_iters)
    with torch.no_grad():
        for j in range(steps):
            new = pb.theta + decay ** j * x
            o, cc, k = pb.objective(new), pb.constraint(new), pb.kl(new)
            ok = (math.isfinite(o) and math.isfinite(cc) and math.isfinite(k) and float(k) <= kl_slack * delta
                  and float(cc - con0) <= max(-pb.c, 0.0) + tol and (float(o - obj0) >= 0 or case <= 1))
            if ok:
                return new, j, case
    return pb.theta.clone(), steps, case


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problems")
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    d = dict(np.load(a.problems))
    P = d["W0"].shape[0]
    delta, cg, steps = float(d["delta"]), int(d["cg_iters"]), int(d["backtrack_steps"])
    probs = [Problem(d, p) for p in range(P)]
    cpo_step(probs[0], delta, cg, steps)  # warm-up
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        cpo_step(probs[0], delta, cg, steps)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = [cpo_step(pb, delta, cg, steps) for pb in probs]
    loop_s = time.perf_counter() - t0
    res = {"single_s": sorted(times)[len(times) // 2], "loop_s": loop_s, "problems": P, "threads": a.threads,
           "torch": torch.__version__, "backtracks": [j for _, j, _ in outs], "cases": [c for _, _, c in outs],
           "params": [o.detach().numpy().tolist() for o, _, _ in outs]}
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
