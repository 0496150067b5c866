"""CPO trust-region step (Achiam et al. 2017; CCPO paper, arXiv 2511.11828, Eq. 7) against a
closed-form float64 optimum checked by the KKT conditions (no solver, so no solver version to
depend on), jnp.linalg.solve, an explicit Fisher matrix and a sequential NumPy line search."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as cf
from ccpo_jax.core import networks
from ccpo_jax.core import trust_region as tr

N = 6


def _problem(seed, case):
    """Random SPD H, g, b, delta, and c chosen so that the problem lands in ``case``."""
    rng = np.random.default_rng(seed)
    M = rng.normal(size=(N, N))
    H = M @ M.T / N + 0.2 * np.eye(N)
    g, b = rng.normal(size=N), rng.normal(size=N)
    delta = float(rng.uniform(0.005, 0.5))
    s = b @ np.linalg.solve(H, b)
    edge = np.sqrt(2 * delta * s)  # |c| at which B = 0
    u = rng.uniform(0.2, 0.9)
    c = {3: -edge / u, 2: -u * edge, 1: u * edge, 0: edge / u, 4: -u}[case]
    if case == 4:
        b = np.zeros(N)
    return [x.astype(np.float32) for x in (H, g, b)] + [np.float32(c), np.float32(delta)]


def _exact(H, g, b, c, delta):
    """Closed-form optimum in float64, derived geometrically (no solver, no dual formulas).

    With H = L L' and y = L'x the problem is: maximise gh'y subject to |y|^2 <= r^2 = 2 delta and
    c + bh'y <= 0, where gh = L^-1 g, bh = L^-1 b. If even the best point of the ball, y = -r bh/|bh|,
    violates the plane (c - r|bh| > 0), the step minimises the violation: y = -r bh/|bh|. Else the
    TRPO point r gh/|gh| if it satisfies the plane; else the optimum lies on the disc where plane and
    ball meet: y = y0 + rho gp/|gp|, y0 = -c bh/|bh|^2 (the plane's point nearest 0),
    rho = sqrt(r^2 - |y0|^2), gp = the part of gh orthogonal to bh. :func:`_assert_kkt` checks it.
    """
    H, g, b = (np.asarray(x, np.float64) for x in (H, g, b))
    c, delta = float(c), float(delta)
    L = np.linalg.cholesky(H)
    gh, bh = np.linalg.solve(L, g), np.linalg.solve(L, b)
    r = np.sqrt(2 * delta)
    nb = np.linalg.norm(bh)
    if nb > 0 and c - r * nb > 0:
        y = -r * bh / nb
    else:
        y = r * gh / np.linalg.norm(gh)
        if c + bh @ y > 0:
            y0 = -c * bh / nb**2
            gp = gh - (gh @ bh) / nb**2 * bh
            y = y0 + np.sqrt(max(r * r - y0 @ y0, 0.0)) * gp / np.linalg.norm(gp)
    return np.linalg.solve(L.T, y)


def _assert_kkt(H, g, b, c, delta, x, tol):
    """The KKT conditions of the (convex) step problem at ``x``; multipliers fitted by least squares.

    Feasible problem (max g'x s.t. 0.5 x'Hx - delta <= 0, c + b'x <= 0): stationarity
    g = mu1 Hx + mu2 b, dual feasibility mu >= 0, complementary slackness mu_i h_i = 0, primal
    feasibility h_i <= 0. Infeasible one (min b'x s.t. 0.5 x'Hx <= delta): -b = mu1 Hx, mu1 >= 0,
    0.5 x'Hx = delta. With Slater's condition these are sufficient, and the optimum is unique.
    Returns (mu1, mu2).
    """
    H, g, b, x = (np.asarray(v, np.float64) for v in (H, g, b, x))
    c, delta = float(c), float(delta)
    Hx = H @ x
    h1, h2 = 0.5 * x @ Hx - delta, c + b @ x
    infeasible = c - np.sqrt(2 * delta * (b @ np.linalg.solve(H, b))) > 0
    if infeasible:
        A, rhs = Hx[:, None], -b
    else:
        A, rhs = np.stack([Hx, b], 1), g
    mu = np.linalg.lstsq(A, rhs, rcond=None)[0]
    scale = np.linalg.norm(rhs)
    assert np.linalg.norm(A @ mu - rhs) <= tol * scale, ("stationarity", A @ mu - rhs)
    assert (mu >= -tol * (1 + np.abs(mu).max())).all(), ("dual feasibility", mu)
    assert abs(h1) * mu[0] <= tol * (1 + mu[0]) * delta, ("complementary slackness (trust region)", h1, mu)
    assert h1 <= tol * delta, ("primal feasibility (trust region)", h1)
    if infeasible:
        return float(mu[0]), 0.0
    assert abs(h2) * mu[1] <= tol * (1 + abs(mu[1])) * (1 + abs(c)), ("complementary slackness (plane)", h2, mu)
    assert h2 <= tol * (1 + abs(c)), ("primal feasibility (plane)", h2)
    return float(mu[0]), float(mu[1])


def _oracle(H, g, b, c, delta):
    x = _exact(H, g, b, c, delta)
    _assert_kkt(H, g, b, c, delta, x, tol=1e-8)
    return x


def _direction(H, g, b, c, delta):
    Hj = jnp.asarray(H)
    return tr.cpo_direction(jnp.asarray(g), jnp.asarray(b), c, lambda v: Hj @ v, delta, cg_iters=2 * N)


@pytest.mark.parametrize("case", [0, 1, 2, 3, 4])
def test_direction_is_the_kkt_optimum_in_every_case(case):
    direction = jax.jit(_direction)
    for seed in range(6):
        H, g, b, c, delta = _problem(100 * case + seed, case)
        x, info = direction(H, g, b, c, delta)
        assert int(info.case) == case
        ref = _oracle(H, g, b, c, delta)
        np.testing.assert_allclose(np.asarray(x), ref, atol=1e-4 * max(1.0, np.abs(ref).max()),
                                   err_msg=f"case {case} seed {seed}")
        mu1, mu2 = _assert_kkt(H, g, b, c, delta, x, tol=2e-3)  # the float32 step itself
        if case in (1, 2, 3, 4):  # the implementation's duals are the KKT multipliers
            np.testing.assert_allclose([float(info.lam), float(info.nu)], [mu1, mu2], rtol=2e-3, atol=2e-3)


def test_partially_feasible_covers_active_and_inactive_constraint():
    # in case 2 the optimum is sometimes the plain TRPO step (nu = 0) and sometimes on the plane
    nus = []
    direction = jax.jit(_direction)
    for seed in range(30):
        H, g, b, c, delta = _problem(7000 + seed, 2)
        x, info = direction(H, g, b, c, delta)
        np.testing.assert_allclose(np.asarray(x), _oracle(H, g, b, c, delta), atol=1e-4)
        nus.append(float(info.nu))
    assert min(nus) == 0.0 and max(nus) > 0.0


def test_cg_matches_solve():
    rng = np.random.default_rng(0)
    M = rng.normal(size=(20, 20))
    H = jnp.asarray(M @ M.T / 20 + 0.5 * np.eye(20), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=20), jnp.float32)
    x = jax.jit(lambda r: tr.conjugate_gradient(lambda v: H @ v, r, iters=40))(rhs)
    np.testing.assert_allclose(x, jnp.linalg.solve(H, rhs), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_policy():
    net = networks.policy_net(hidden=(5,))
    obs = jax.random.normal(jax.random.PRNGKey(0), (7, 3))
    avail = jnp.ones((7, 3), bool).at[::2, 2].set(False)
    params = net.init(jax.random.PRNGKey(1), obs)
    params = jax.tree.map(lambda p: p * 30.0 if p.ndim == 2 and p.shape[1] == 3 else p, params)  # non-uniform pi

    def logpolicy(p):
        probs = networks.masked_probs(net.apply(p, obs), avail)
        return cf.soft_conformal_log_policy(probs, 0.3, avail, eps=0.1)

    old = jax.lax.stop_gradient(logpolicy(params))
    kl_fn = lambda p: jnp.mean(cf.soft_policy_kl(old, logpolicy(p)))
    return params, kl_fn, logpolicy, avail


def test_kl_hessian_matches_explicit_fisher(tiny_policy):
    params, kl_fn, logpolicy, avail = tiny_policy
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    H = jax.jit(jax.hessian(lambda z: kl_fn(unravel(z))))(flat)
    # independent Fisher: mean_i sum_a S(a) grad log S(a) grad log S(a)^T
    J = jax.jit(jax.jacobian(lambda z: jnp.where(avail, logpolicy(unravel(z)), 0.0)))(flat)  # [B, A, P]
    p = jnp.where(avail, jnp.exp(logpolicy(params)), 0.0)
    F = jnp.einsum("ba,bap,baq->pq", p, J, J) / p.shape[0]
    np.testing.assert_allclose(H, F, atol=1e-4 * float(jnp.abs(F).max()))


@pytest.mark.parametrize("what", ["b0", "s0", "illcond", "g0", "all0"])
def test_no_nan_in_degenerate_problems(what):
    rng = np.random.default_rng(3)
    H, g, b, _, delta = _problem(3, 2)
    if what == "illcond":
        Q, _ = np.linalg.qr(rng.normal(size=(N, N)))
        H = (Q * np.logspace(-9, 0, N)) @ Q.T
    for c in (-0.3, 0.0, 0.3):
        gg, bb = g.copy(), b.copy()
        if what == "b0":
            bb = bb * 1e-20
        if what == "s0":
            bb = bb * 1e-6
        if what == "g0":
            gg = gg * 0
        if what == "all0":
            gg, bb = gg * 0, bb * 0
        x, info = _direction(H.astype(np.float32), gg, bb, np.float32(c), delta)
        leaves = jax.tree.leaves(info) + [x]
        assert all(np.isfinite(np.asarray(l)).all() for l in leaves), (what, c, info)
        assert float(0.5 * x @ jnp.asarray(H, jnp.float32) @ x) <= delta * 1.01 + 1e-6
        if what in ("b0", "s0") and c < 0:  # constraint gradient ~ 0 and feasible: TRPO step
            assert int(info.case) == 4
            ref = _oracle(H, g, np.zeros(N, np.float32), c, delta)
            np.testing.assert_allclose(np.asarray(x), ref, atol=1e-4)


# ----------------------------------------------------------------------------- pytree-level update


def _quad_setup(seed, case, quartic=0.0):
    H, g, b, c, delta = _problem(seed, case)
    theta0 = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
    flat0, unravel = jax.flatten_util.ravel_pytree(theta0)
    Hj, gj, bj = jnp.asarray(H), jnp.asarray(g), jnp.asarray(b)
    d = lambda p: jax.flatten_util.ravel_pytree(p)[0] - flat0
    objective = lambda p: gj @ d(p) - quartic * jnp.sum(d(p) ** 2) ** 2  # quartic: zero grad/Hessian at theta0
    constraint = lambda p: bj @ d(p)
    kl = lambda p: 0.5 * d(p) @ Hj @ d(p)
    return theta0, flat0, objective, constraint, kl, (H, g, b, c, delta)


@pytest.mark.parametrize("case", [0, 1, 2, 3, 4])
def test_update_on_exact_quadratic_takes_the_full_optimal_step(case):
    theta0, flat0, objective, constraint, kl, (H, g, b, c, delta) = _quad_setup(11 + case, case)
    new, info = jax.jit(lambda p: tr.cpo_update(p, objective, constraint, kl, c, delta, damping=0.0,
                                                cg_iters=2 * N))(theta0)
    assert bool(info.accepted) and float(info.step_frac) == 1.0 and int(info.direction.case) == case
    step = jax.flatten_util.ravel_pytree(new)[0] - flat0
    np.testing.assert_allclose(step, _oracle(H, g, b, c, delta), atol=2e-4)


def _sequential_line_search(f0, fracs, obj, kl, con, c, delta, case, slack=1.5):
    """Oracle: jachiam-style sequential backtracking loop in NumPy."""
    for j, f in enumerate(fracs):
        o, k, dc = obj(f), kl(f), con(f)
        if k <= slack * delta and dc <= max(-c, 0.0) and (case <= 1 or o - f0 >= 0):
            return j, f
    return None, 0.0


def test_line_search_keeps_a_step_accepted_on_the_last_iteration_and_rejects_when_none_pass():
    theta0, flat0, _, constraint, kl, (H, g, b, c, delta) = _quad_setup(5, 3)
    x, _ = _direction(H, g, b, c, delta)
    x = np.asarray(x, np.float64)
    gx, xx = float(g @ x), float(x @ x)
    fracs = 0.8 ** np.arange(15)
    for target, expect in ((14, 14), (None, None)):
        # improvement f g'x - K f^4 |x|^4 >= 0  <=>  f^3 <= g'x / (K |x|^4)
        f_cut = (fracs[13] + fracs[14]) / 2 if target == 14 else fracs[14] * 0.9
        K = gx / (f_cut ** 3 * xx ** 2)
        _, _, objective, _, _, _ = _quad_setup(5, 3, quartic=K)
        new, info = jax.jit(lambda p: tr.cpo_update(p, objective, constraint, kl, c, delta, damping=0.0,
                                                    cg_iters=2 * N))(theta0)
        j_ref, f_ref = _sequential_line_search(
            0.0, fracs, lambda f: f * gx - K * f ** 4 * xx ** 2, lambda f: f * f * 0.5 * x @ H @ x,
            lambda f: f * b @ x, c, delta, 3)
        assert j_ref == expect
        step = jax.flatten_util.ravel_pytree(new)[0] - flat0
        if expect is None:
            assert not bool(info.accepted) and float(jnp.abs(step).max()) == 0.0
        else:
            assert bool(info.accepted) and int(info.n_backtracks) == 14
            np.testing.assert_allclose(step, f_ref * x, rtol=1e-4, atol=1e-7)


def test_jit_vmap_100_problems_equal_unbatched_no_retrace():
    probs = [_problem(9000 + i, i % 5) for i in range(100)]
    H, g, b, c, delta = (jnp.asarray(np.stack([p[k] for p in probs])) for k in range(5))

    def direction(H, g, b, c, delta):
        return tr.cpo_direction(g, b, c, lambda v: H @ v, delta, cg_iters=2 * N)

    def update(H, g, b, c, delta):
        theta = {"a": jnp.zeros(4), "b": jnp.zeros(2)}
        flat = lambda p: jax.flatten_util.ravel_pytree(p)[0]
        return tr.cpo_update(theta, lambda p: g @ flat(p), lambda p: b @ flat(p),
                             lambda p: 0.5 * flat(p) @ H @ flat(p), c, delta, damping=0.0, cg_iters=2 * N)

    def cg(H, g, b, c, delta):
        return tr.conjugate_gradient(lambda v: H @ v, g, iters=2 * N)

    for name, f in (("direction", direction), ("update", update), ("cg", cg)):
        batched = jax.jit(jax.vmap(chex.assert_max_traces(f, n=1)))
        out = batched(H, g, b, c, delta)
        batched(H, g * 2, b, c, delta)  # no retrace
        single = jax.jit(f)
        for i in (0, 1, 2, 3, 4, 57):
            one = single(H[i], g[i], b[i], c[i], delta[i])
            for u, v in zip(jax.tree.leaves(one), jax.tree.leaves(out)):
                np.testing.assert_allclose(np.asarray(u), np.asarray(v[i]), rtol=1e-4, atol=1e-5, err_msg=name)


def test_fisher_product_equals_the_hessian_of_the_kl_at_theta_k():
    """fisher_vector_product against an independent oracle: jax.hessian of the weighted KL of a
    small softmax model with an impossible action, at theta_k (where the two matrices agree)."""
    key = jax.random.PRNGKey(3)
    k1, k2, k3 = jax.random.split(key, 3)
    X = jax.random.normal(k1, (7, 4))
    avail = jnp.ones((7, 3), bool).at[2, 1].set(False).at[5, 2].set(False)
    w = jax.random.uniform(k2, (7,)) + 0.1
    w = w / w.sum()
    theta = 0.5 * jax.random.normal(k3, (4 * 3,))

    def logp(t):
        z = jnp.where(avail, X @ t.reshape(4, 3), -jnp.inf)
        return jax.nn.log_softmax(z, axis=-1)

    lp0 = jax.lax.stop_gradient(logp(theta))

    def kl(t):
        p0 = jnp.exp(lp0)
        d = jnp.where(avail, lp0 - jnp.where(avail, logp(t), 0.0), 0.0)
        return jnp.sum(w * jnp.sum(p0 * d, -1))

    H = jax.hessian(kl)(theta)
    fvp = tr.fisher_vector_product(logp, w, theta)
    F = jax.vmap(fvp)(jnp.eye(theta.shape[0])).T
    assert np.all(np.isfinite(np.asarray(F)))
    np.testing.assert_allclose(np.asarray(F), np.asarray(H), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(H).max()) > 1e-2  # a non-trivial matrix


def test_cpo_update_with_the_fisher_product_takes_the_hessian_step():
    """cpo_update(fisher=...) and the default (the KL's Hessian) give the same step."""
    X = jax.random.normal(jax.random.PRNGKey(4), (9, 4))
    y = jax.random.randint(jax.random.PRNGKey(5), (9,), 0, 3)
    theta = {"w": 0.3 * jax.random.normal(jax.random.PRNGKey(6), (4, 3))}
    w = jnp.full((9,), 1.0 / 9)

    def logp(p):
        return jax.nn.log_softmax(X @ p["w"], axis=-1)

    lp0 = jax.lax.stop_gradient(logp(theta))
    objective = lambda p: jnp.mean(jnp.take_along_axis(logp(p), y[:, None], 1))
    constraint = lambda p: -jnp.mean(jnp.exp(logp(p))[:, 0])
    kl = lambda p: jnp.sum(w * jnp.sum(jnp.exp(lp0) * (lp0 - logp(p)), -1))
    a, _ = tr.cpo_update(theta, objective, constraint, kl, -0.01, 0.01, damping=1e-3)
    b, _ = tr.cpo_update(theta, objective, constraint, kl, -0.01, 0.01, damping=1e-3, fisher=(logp, w))
    np.testing.assert_allclose(np.asarray(b["w"]), np.asarray(a["w"]), rtol=1e-3, atol=1e-6)
    assert float(jnp.abs(a["w"] - theta["w"]).max()) > 1e-4  # a step was taken
