"""Typed configuration of the Stackelberg pipeline (arXiv 2606.23026).

Every value arXiv 2606.23026 leaves open (our choices) is a field here with its
choice documented; docs/stackelberg.md ("Choices where the paper is silent") lists them.
"""
from __future__ import annotations

import dataclasses

from envs.governance.session import LEADER_PROFILE_FIELDS, LEADER_PROFILES, SessionConfig, with_leader_profile


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """Where the response grid comes from."""

    path: str | None = None
    """A grid file (.jsonl) or fast-format directory; None = generate the SYNTHETIC grid."""
    profile: str = "paper-probes"
    """Synthetic profile (envs.governance.synthetic.PROFILES)."""
    seed: int = 0
    """Seed of the synthetic grid."""
    turns: int = 5
    """Turns per synthetic session cell (5: the paper's multi-turn probe)."""
    trials: int = 4
    """Repeated trials per synthetic cell."""


@dataclasses.dataclass(frozen=True)
class SurrogateConfig:
    """Surrogate payoff oracle T-hat, Q-hat (paper §6.3; model class silent: ridge on polynomial features)."""

    test_fraction: float = 0.2
    """Held-out fraction of the fixed train/test split of grid cells."""
    split_seed: int = 0
    """Seed of the fixed split."""
    ridge: float = 1e-3
    """L2 penalty of the ridge regressions (features are O(1))."""
    max_samples: int | None = None
    """Subsample the grid to this many cells before splitting (the paper had 2,400); None = all."""


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """The documented expert behind the demonstrations (s, q, alpha, T_ratio, a) (paper §6.1; silent)."""

    n_demos: int = 4096
    """Number of demonstration tuples (same for both controllers, as in the paper)."""
    action_levels: int = 11
    """The expert maximises U_F (surrogate means) over this many levels per action coordinate."""
    noise: float = 0.03
    """Std of Gaussian jitter on the expert's arg-max action (bounded rationality), clipped to [0, 1]."""
    seed: int = 1
    """Seed of the demonstration sessions (leader outputs drawn uniformly, q in [0.5, 1])."""


@dataclasses.dataclass(frozen=True)
class GAILConfig:
    """Phase 1: follower by GAIL (Ho & Ermon 2016, arXiv 1606.03476; arXiv 2606.23026 §4.2). Hyperparameters: the paper leaves them open; our choice."""

    iterations: int = 300
    """Outer iterations (one discriminator and one PPO step each)."""
    batch: int = 512
    """Expert and policy samples per iteration."""
    hidden: tuple[int, ...] = (64, 64)
    """Hidden sizes of the policy, value and discriminator MLPs."""
    policy_lr: float = 1e-4
    """Policy Adam step (1e-4: GAIL fine-tunes the BC start, bc_init; at 1e-3 it drifted from 0.015 to 0.030 mean
    absolute action error on seed 0)."""
    anneal_lr: bool = False
    """Anneal the policy step linearly from ``policy_lr`` to 0 over ``iterations`` (as LeaderPPOConfig.anneal_lr;
    off: measured 3 of 6 followers within 1.3x of BC against 2 of 6, worse on one; CHANGELOG.md, 2026-12-04)."""
    disc_lr: float = 1e-3
    disc_steps: int = 5
    """Discriminator Adam steps per iteration. At 1 (the default until 2026-12-04) the discriminator's batch
    accuracy stayed at 0.50-0.54, so GAIL's reward barely told its samples from the expert's and the fine-tuning
    wandered off its BC start (1.12-1.53x BC's error on seeds 0-2); at 5 it reaches 0.60-0.70 while GAIL narrows
    its action spread towards the expert's, and GAIL ends at 1.08-1.24x BC's error (10 steps: 1.06-1.26x)."""
    ppo_epochs: int = 4
    """PPO epochs on each policy batch (one-step episodes: the follower is stage-wise)."""
    clip_eps: float = 0.2
    entropy_coef: float = 0.0
    """lambda_H on the policy entropy."""
    grad_penalty: float = 0.1
    """Gradient penalty on the discriminator input gradient (stabilises GAIL; 0 disables)."""
    policy: str = "squashed"
    """Action distribution on [0,1]^3: 'squashed' (sigmoid-squashed Gaussian, default: compiles faster
    under vmap than the Beta's gamma rejection sampler; docs/performance.md#figures-behind-code-comments)
    or 'beta' (distrax.Beta)."""
    bc_init: bool = True
    """Start GAIL from the behaviour-cloning follower: a deviation from the paper's GAIL from scratch, which
    imitated 2-3x worse than BC here (docs/stackelberg.md, "Follower: BC-initialised GAIL")."""
    bc_steps: int = 2000
    """Adam steps of behaviour cloning (the BC follower reported beside GAIL, and GAIL's start if bc_init)."""
    bc_batch: int = 256
    bc_lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class LeaderPPOConfig:
    """Phase 2: leader by PPO over (q, alpha) against the frozen follower in the surrogate."""

    iterations: int = 400
    """(200 stopped 0.02 U_L per session short of the best constant on seed 1; 400 reach it within 0.007.)"""
    n_envs: int = 256
    """Parallel sessions per iteration (each H turns)."""
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 4e-3
    """Adam's starting step (at 3e-4 the 200 iterations moved the squashed policy's logits too little to reach a
    corner; at a constant 2e-3, the default until 2026-12-04, 1 of 6 surrogate gaps to the best constant on seeds
    0-2 was beyond 0.005; annealed from 4e-3, with the 5-step discriminator's follower, 0 of 6 on seeds 0-2 and
    1 of 6 on seeds 3-5; docs/stackelberg.md, "The learners' last mile")."""
    anneal_lr: bool = True
    """Anneal Adam's step linearly from ``lr`` to 0 over ``iterations`` (standard PPO practice, CleanRL's
    ``anneal_lr``). Annealing from 2e-3 halves the summed step and widened every surrogate gap (to 0.006-0.020);
    from 4e-3 the gaps close to within 0.005."""
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.95
    """Discount (paper: H and gamma silent)."""
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 1e-3
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    policy: str = "squashed"
    """Leader distribution on [0,1]^2: 'squashed' or 'beta' (see GAILConfig.policy)."""
    output_margin: float = 0.05
    """m: the raw leader output is clip((1 + 2m) a - m, 0, 1) of the policy's action a in [0, 1]^2, so a
    sigmoid-squashed policy reaches the box's edges at finite logits."""
    follower_deterministic: bool = True
    """The frozen follower plays its mean action (a deterministic response model)."""


@dataclasses.dataclass(frozen=True)
class RepairConfig:
    """Action repair (paper §7.3, §8)."""

    box_low: tuple[float, float, float] = (0.10, 0.35, 0.00)
    box_high: tuple[float, float, float] = (0.40, 0.65, 0.50)
    """A_real = [0.10,0.40] x [0.35,0.65] x [0.00,0.50] for (c, p, u)."""
    u_cap: float = 0.50
    """Cap of the coding-aware tool repair u = min(u_cap, max(u_base, u_need))."""
    need_tolerance: float = 0.02
    """u_need label: the lowest tool level whose mean quality is within this of the best level."""
    ridge: float = 1e-4
    """L2 penalty of the u_need repair head (ridge on task/model/complexity features)."""
    miss_tolerance: float = 0.01
    """A turn is a low-tool miss when its tool budget is below the grid's u_need minus this."""
    trap: tuple[float, float, float] = (0.9, 0.7, 0.5)
    """Trap thresholds: c > 0.9 or p > 0.7 or u > 0.5 (Table 7)."""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation on grid replay (paper §10.2)."""

    paper_episodes: int = 20
    """Episodes of the paper-sized run (20 x 3 turns x 5 strategies = 300 turns)."""
    episodes: int = 10_000
    """Episodes of the large run."""
    turns: int = 3
    middle: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Static 'Middle' action (values silent in the paper)."""
    conservative: tuple[float, float, float] = (0.2, 0.5, 0.2)
    """Static 'Conservative' action (values silent; also the T_0 reference action)."""
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class OracleConfig:
    """Brute-force leader oracles (:mod:`ccpo_jax.stackelberg.oracle`): the learned leader is read against them."""

    levels: int = 21
    """Grid levels per leader coordinate (q, alpha): levels^2 constant candidates."""
    select_sessions: int = 1000
    """Sessions on which the best constant / table is chosen."""
    score_sessions: int = 1000
    """Fresh sessions on which the chosen policies, the learned and the untrained leader are scored."""
    seed: int = 7
    """Seed of the selection and scoring sessions (folded with the run seed)."""


@dataclasses.dataclass(frozen=True)
class StackelbergConfig:
    """The whole pipeline: grid -> surrogate -> GAIL follower -> PPO leader -> repair -> evaluation."""

    grid: GridConfig = GridConfig()
    surrogate: SurrogateConfig = SurrogateConfig()
    session: SessionConfig = SessionConfig()
    expert: ExpertConfig = ExpertConfig()
    gail: GAILConfig = GAILConfig()
    leader: LeaderPPOConfig = LeaderPPOConfig()
    repair: RepairConfig = RepairConfig()
    eval: EvalConfig = EvalConfig()
    oracle: OracleConfig = OracleConfig()
    seeds: int = 2
    """Training seeds, vmapped in one program; the seed with the best surrogate leader return is evaluated."""
    seed: int = 0
    chunks: int = 10
    """Training is split into this many jitted chunks (progress bar, TensorBoard, checkpoint per chunk)."""
    leader_profile: str = "paper"
    """The leader's utility (envs.governance.session.LEADER_PROFILES): 'paper' (savings + 2 quality - 0.1 subsidy
    on every task) or the SYNTHETIC 'state-feedback' (savings weight -1 on the first three task types), whose
    best leader policy depends on the task. ``session`` must carry that profile's weights: build it with
    :meth:`with_leader_profile`."""
    leader_learner: str = "ppo"
    """The leader's learner, a row of :data:`ccpo_jax.stackelberg.leaders.LEADER_LEARNERS` ('ppo': the paper's)."""

    def __post_init__(self):
        if self.leader_profile not in LEADER_PROFILES:
            raise ValueError(f"StackelbergConfig.leader_profile must be one of {sorted(LEADER_PROFILES)}, "
                             f"got {self.leader_profile!r}")
        want = with_leader_profile(self.session, self.leader_profile)
        for f in LEADER_PROFILE_FIELDS:
            if getattr(self.session, f) != getattr(want, f):
                raise ValueError(f"StackelbergConfig: session.{f}={getattr(self.session, f)!r} is not leader profile "
                                 f"{self.leader_profile!r}'s {getattr(want, f)!r}; use with_leader_profile()")

    def with_leader_profile(self, name: str) -> "StackelbergConfig":
        """This configuration under leader utility profile ``name`` (its name and the session's weights)."""
        return dataclasses.replace(self, leader_profile=name, session=with_leader_profile(self.session, name))

    @property
    def synthetic_leader(self) -> bool:
        """Whether the leader utility is a SYNTHETIC profile (every profile but the paper's)."""
        return self.leader_profile != "paper"

    def quick(self) -> "StackelbergConfig":
        """A small configuration for smoke tests (--quick): same code paths, tiny sizes."""
        r = dataclasses.replace
        return r(
            self,
            grid=r(self.grid, trials=2),
            expert=r(self.expert, n_demos=512),
            gail=r(self.gail, iterations=20, batch=128, bc_steps=200),
            leader=r(self.leader, iterations=10, n_envs=64),
            eval=r(self.eval, episodes=1000),
            oracle=r(self.oracle, levels=11, select_sessions=300, score_sessions=300),
            seeds=2,
            chunks=2,
        )
