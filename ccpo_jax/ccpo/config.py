"""Typed configuration of the CCPO trainer (arXiv 2511.11828, section 5.1 and Algorithm 1).

The defaults are the ``default`` preset (:mod:`ccpo_jax.ccpo.presets`), the configuration
that learns on the oracle caches; each field's docstring gives the paper's value, and
``ccpo_jax.ccpo.presets.PAPER`` is the paper's published setting. A config is static (hashable) so it can close over a
jitted train function; the per-variant switches (conformal target, lambda) are
data, so that rows of the paper's tables train in one vmapped program.
"""
from __future__ import annotations

import dataclasses

from ccpo_jax.errors import UserError


#: Constraint/objective estimators of the CPO step (TrainConfig.estimator).
ESTIMATORS = ("exact", "jbar", "vtrace")
#: Targets of the CCPO rows under the exact estimator (TrainConfig.ccpo_target).
CCPO_TARGETS = ("set", "stochastic")
#: How the CPO step applies the KL's Hessian H in conjugate gradient (TrainConfig.hvp).
HVPS = ("fisher", "kl-hessian")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    iterations: int = 100
    """Policy iterations (paper: 1,500-2,000; the default preset's replay-exact steps converge in far fewer)."""
    batch_size: int = 10
    """Training questions (episodes) per iteration (paper: 10)."""
    delta: float = 0.01
    """KL trust-region radius on the softmasked policy (paper: 0.01)."""
    softmask_eps: float = 0.01
    """Temperature of the softmask sigma((pi - kappa) / eps) (paper: 0.01)."""
    critic_lr: float = 1e-3
    """Adam learning rate of both critics (paper: 1e-3)."""
    critic_steps: int = 4
    """Adam steps on the V-trace targets per iteration (our choice; paper silent)."""
    hidden: tuple[int, ...] = (64, 64, 64)
    """Hidden layers of the policy and both critics (paper: three layers of 64)."""
    cg_iters: int = 5
    """Conjugate-gradient iterations (paper silent; jachiam/cpo: 10, the paper preset's value;
    the replay-exact step needs fewer: default 5)."""
    hvp: str = "fisher"
    """How conjugate gradient applies H, the Hessian of the mean KL at theta_k (see HVPS; paper
    silent): ``fisher`` = as the Fisher matrix J' diag(w p) J of the target policy's
    log-probabilities, one forward tangent and its transpose per product
    (``ccpo_jax.core.trust_region.fisher_vector_product``), the same matrix at theta_k;
    ``kl-hessian`` = by differentiating the KL twice (jachiam/cpo's way; slower on CPU:
    docs/performance.md#figures-behind-code-comments).
    The two agree to float rounding."""
    damping: float = 1e-3
    """Fisher damping (our choice: the Fisher of 10 episodes x 4 rounds is rank-deficient,
    jachiam's 1e-5 makes CG ill-conditioned there)."""
    backtrack_steps: int = 8
    """Backtracking line-search candidates (paper silent; jachiam: 15, the paper preset's value; default 8)."""
    backtrack_decay: float = 0.8
    """Step shrink factor of the line search (jachiam/OmniSafe: 0.8)."""
    kappa0: float = 1.0 / 3.0
    """Initial conformal threshold (our choice: 1/3 keeps the set non-empty with 3 actions)."""
    eta0: float = 0.05
    """Online-kappa base step, eta_k = eta0 k^-(1/2 + xi) (our choice; paper silent)."""
    xi: float = 0.1
    """Conformal decay exponent (paper: 0.1)."""
    chunk: int = 50
    """Iterations per compiled chunk: progress, TensorBoard and checkpoints happen between chunks."""
    estimator: str = "exact"
    """How the CPO step estimates the objective and the coverage constraint (see ESTIMATORS):
    ``jbar`` = the paper's Eq. 8 (importance-weighted J-bar from ``batch_size`` sampled
    episodes, V-trace reward advantages); ``vtrace`` = the constraint critic's V-trace
    estimate of J_C (this project's first trainer); ``exact`` = replay-exact expected cost
    and success of the target policy over ``exact_batch`` questions' whole cached chains
    (goes beyond the paper: no sampling variance, no critics)."""
    ccpo_target: str = "set"
    """What the CCPO rows optimise with ``estimator="exact"``: ``stochastic`` = cost and success of
    the stochastic conformal policy S~ (one answer drawn from the set; the paper's target,
    Eq. 3 and 8); ``set`` = expected cost, coverage and size of the set-valued rollout of
    C_{pi,kappa} itself with softmask inclusion (``ccpo_jax.core.exact.soft_set_outcomes``), the
    quantities the calibrated row is evaluated on (beyond the paper)."""
    exact_batch: int = 64
    """Questions per iteration for ``estimator="exact"``; 0 = the whole training pool."""
    constraint_z: float = 0.0
    """Margin of the calibrated rows (CPO batch, CPO online, CCPO): enforce the coverage
    constraint on the estimate minus ``constraint_z`` standard errors of its mean over the
    iteration's questions (episodes); 0 = on the estimate itself (the paper). Calibration on
    held-out questions sets these rows' coverage, so a margin only makes them over-cover
    (docs/results.md, "The default preset")."""
    pointwise_z: float = 3.0
    """Margin of the pointwise CPO row (``CPO``, read without calibration): as ``constraint_z``.
    It needs one to meet its own constraint (0.876-0.893 success at 0; paper: 0). When it
    differs from ``constraint_z`` the CPO policy trains twice, once per margin (``CPO_ROWS``)."""

    def __post_init__(self) -> None:
        self.validate()  # a direct TrainConfig(...) is checked too, not only .replace()

    def validate(self) -> "TrainConfig":
        checks = [
            (self.iterations >= 1, f"iterations must be >= 1, got {self.iterations}"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.delta > 0, "delta must be > 0"),
            (self.softmask_eps > 0, "softmask_eps must be > 0"),
            (self.chunk >= 1, "chunk must be >= 1"),
            (0.0 <= self.kappa0 <= 1.0, "kappa0 must be in [0, 1]"),
            (self.estimator in ESTIMATORS, f"estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}"),
            (self.exact_batch >= 0, "exact_batch must be >= 0 (0 = the whole training pool)"),
            (self.constraint_z >= 0, "constraint_z must be >= 0"),
            (self.pointwise_z >= 0, "pointwise_z must be >= 0"),
            (self.hvp in HVPS, f"hvp must be one of {', '.join(HVPS)}, got {self.hvp!r}"),
            (self.ccpo_target in CCPO_TARGETS, f"ccpo_target must be one of {', '.join(CCPO_TARGETS)}, got {self.ccpo_target!r}"),
            (self.critic_steps >= 0, "critic_steps must be >= 0"),
            (self.cg_iters >= 1, "cg_iters must be >= 1"),
            (self.backtrack_steps >= 1, "backtrack_steps must be >= 1"),
            (0.0 < self.backtrack_decay < 1.0, "backtrack_decay must be in (0, 1)"),
            (self.damping >= 0, "damping must be >= 0"),
            (self.critic_lr > 0, "critic_lr must be > 0"),
            (self.eta0 >= 0, "eta0 must be >= 0"),
            (len(self.hidden) >= 1 and all(h >= 1 for h in self.hidden), "hidden must be one or more positive layer sizes"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)
        return self

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw).validate()


#: The rows a vanilla CPO policy serves: its pointwise action, its batch-calibrated and its online sets.
CPO_ROWS = ("CPO", "CPO batch", "CPO online")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One trained row family. ``conformal`` False = vanilla CPO (pointwise target pi),
    True = CCPO (target: the softmasked stochastic conformal policy S~_{pi,kappa}).

    ``rows``: the table rows this variant's policy serves (None: its own name for CCPO,
    :data:`CPO_ROWS` for CPO). ``z``: its coverage margin in standard errors (None: the
    config's ``constraint_z`` for CCPO, ``pointwise_z`` for CPO; see :meth:`margin`).
    ``alpha``: its target miscoverage, the one the trainer and the calibration read (a run's alpha
    has one home, ``ReproduceConfig.alpha`` / ``SweepConfig.alphas``, from which
    ``ccpo_jax.ccpo.rows.row_variants`` sets it), traced like ``lam``, so that a sweep over alpha
    trains in one program (:mod:`ccpo_jax.ccpo.sweep`)."""

    name: str
    conformal: bool
    lam: float = 0.0
    z: float | None = None
    rows: tuple[str, ...] | None = None
    alpha: float = 0.1

    def table_rows(self) -> tuple[str, ...]:
        if self.rows is not None:
            return tuple(self.rows)
        return (self.name,) if self.conformal else CPO_ROWS

    def margin(self, config: TrainConfig) -> float:
        if self.z is not None:
            return float(self.z)
        return float(config.constraint_z if self.conformal else config.pointwise_z)
