"""The calibrated profiles of the SYNTHETIC cache generator (:mod:`envs.generators.synthetic`).

A profile is the parameters of the generative model (described in
:mod:`envs.generators.synthetic`), the paper targets it was fit to (arXiv 2511.11828,
Tables 2-5, read from :mod:`envs.published`) and the fitted numbers, written here from
``python -m envs.generators.synthetic --calibrate``. Data and its types only: drawing a
cache, measuring it and refitting live in :mod:`envs.generators.synthetic`.
"""
from __future__ import annotations

import dataclasses
import math

from envs import published
from envs.cache.schema import CacheError, ModelInfo

DEFAULT_PROFILE = "hotpotqa-llama2"
T_ROUNDS = 4
GUIDE = ModelInfo("gpt-4o", 2.5, 10.0)  # GPT-4o list price, USD per million tokens (the paper states none; our choice)
PAPER = published.PAPER


# ---------------------------------------------------------------------------
# parameters


@dataclasses.dataclass(frozen=True)
class Target:
    """A marginal the generator is calibrated to.

    ``sd`` is the per-question standard deviation of the quantity (measured on
    the calibration run), so the sampling standard error at n questions is
    ``sd / sqrt(n)``; ``margin`` is the model/calibration error we allow on top.
    Tolerance = 3 standard errors + margin.
    """

    value: float
    sd: float
    margin: float
    source: str

    def tol(self, n: int) -> float:
        return 3.0 * self.sd / math.sqrt(n) + self.margin


@dataclasses.dataclass(frozen=True)
class ChainParams:
    """Base/guide chain (module docstring). Probit units unless said otherwise."""

    mu_b: float  # base ability (fit: Random coverage)
    mu_g: float  # guide ability (fit: guide round-1 coverage)
    s: float  # difficulty loading, shared by base and guide (fit: unsolvable share)
    delta: tuple[float, ...] = (0.0, 0.15, 0.25, 0.3)  # base retry gain per round (probit shift)
    n_wrong: int = 7  # wrong answers in the per-question pool (<= 2T - 1)
    p_wrong_geom: float = 0.55  # geometric weight of the first wrong answer
    p_adopt: float = 0.15  # base adopts the guide's previous correction
    p_repeat_right: float = 0.85
    p_repeat_wrong: float = 0.45
    p_misjudge: float = 0.06  # guide knows but judges wrongly
    p_yes_unknown: float = 0.45
    p_yes_informative: float = 0.2
    p_lucky: float = 0.12
    u0: float = -1.4  # guide uncertainty logit intercept
    u_unknown: float = 1.6
    u_no: float = 0.3
    u_d: float = 0.3
    u_sd: float = 0.7
    conf0: float = 0.6  # base confidence logit
    conf_correct: float = 0.5
    conf_d: float = -0.2
    conf_sd: float = 0.9


@dataclasses.dataclass(frozen=True)
class TokenParams:
    """Token counts (module docstring)."""

    q_tokens: float  # mean question tokens in the guide prompt (fit: cents per guide call)
    q_cv: float = 0.3
    template: float = 32.0  # guide prompt template (arXiv 2511.11828, App. 8.1)
    ans_tokens: float = 2.5  # mean extra answer tokens (1 + Poisson)
    base_system: float = 1100.0  # base few-shot prompt
    base_out: float = 180.0  # base completion tokens per round
    base_obs: float = 450.0  # tool observations added to the base context per round (0 on MMLU)


@dataclasses.dataclass(frozen=True)
class ExitParams:
    """One model's cached LLM-EXIT run (module docstring)."""

    e0: float  # correctness offset (fit: matched coverage)
    c0: float  # continue offset (fit: average length)
    cost_round: float = 0.0  # mean cents per round (fit: cost); 0 for a local model
    e_d: float = 1.0
    c_d: float = 0.6
    c_wrong: float = 0.5
    cost_cv: float = 0.5


@dataclasses.dataclass(frozen=True)
class PolicyParams:
    """One model's cached LLM-as-policy actions (module docstring)."""

    n0: float  # next-round offset (fit: average length)
    skill: float  # in [-1, 1] (fit: coverage)
    n_err: float = 0.0
    n_unc: float = 0.0
    p_guide: float = 0.5


@dataclasses.dataclass(frozen=True)
class Profile:
    """A calibrated generator: parameters plus the paper targets it was fit to."""

    name: str
    task: str  # "hotpotqa" | "mmlu"
    base_model: str
    table: str  # the paper table the targets come from
    description: str
    chain: ChainParams
    tokens: TokenParams
    exit_gpt4o: ExitParams
    exit_base: ExitParams
    policy_gpt4o: PolicyParams
    policy_base: PolicyParams
    targets: dict[str, Target]

    @property
    def models(self) -> tuple[str, str]:
        """Model order of the cached EXIT and LLM-policy columns."""
        return (GUIDE.name, self.base_model)


# ---------------------------------------------------------------------------
# profiles

# Margins: 0.01 on calibrated shares (calibration error on 100k questions is far
# smaller; the margin covers refits), 0.03 on Random coverage (the paper's own
# Random rows vary by that much), looser on quantities the model only
# approximates (stated per target).


def _t(value: float, sd: float, margin: float, source: str) -> Target:
    return Target(value, sd, margin, source)


def _finish(tg: dict[str, Target], sds: dict[str, float], margins: dict[str, tuple[float, str]] | None) -> dict[str, Target]:
    """Fill in the measured sds and any per-profile margin (with the reason, kept in the source)."""
    out = {k: dataclasses.replace(v, sd=sds.get(k, v.sd)) for k, v in tg.items()}
    for k, (margin, why) in (margins or {}).items():
        out[k] = dataclasses.replace(out[k], margin=margin, source=f"{out[k].source}; margin {margin}: {why}")
    return out


def _hotpot_targets(n: int, g1: float, sds: dict[str, float],
                    margins: dict[str, tuple[float, str]] | None = None) -> dict[str, Target]:
    """Targets of the profile calibrated to Table ``n`` (read from :mod:`envs.published`);
    ``g1``: the guide's round-1 coverage, read off the table's CPO/UALA rows at length ~1."""
    table = f"Table {n}"
    base_exit_cov, base_exit_len = published.value(n, "BX", "coverage"), published.value(n, "BX", "avg_len")
    random_cov = published.value(n, "Random", "coverage")
    pol_g = (published.value(n, "GP", "coverage"), published.value(n, "GP", "avg_len"))
    pol_b = (published.value(n, "BP", "coverage"), published.value(n, "BP", "avg_len"))
    gx = published.row(n, "GX")
    tg = {
        "unsolvable": _t(0.10, 0.3, 0.02, "our choice (plausible share; paper silent)"),
        "guide_round1_coverage": _t(g1, 0.37, 0.01, f"{table}: CPO coverage at length ~1"),
        "random_coverage": _t(random_cov, 0.3, 0.03, f"{table}: Random"),
        "cents_per_guide_call": _t(0.0225, 0.003, 0.0008, "CCPO paper Tables 2-3: ~0.022 c per guide call (rows at length ~1)"),
        "guide_verdict_accuracy": _t(0.82, 0.2, 0.04, "our choice (~80-85%)"),
        "gpt4o_exit_coverage": _t(gx["coverage"], 0.29, 0.01, "Tables 2-3: GPT-4o EXIT"),
        "gpt4o_exit_len": _t(gx["avg_len"], 1.1, 0.03, "Tables 2-3: GPT-4o EXIT"),
        "gpt4o_exit_cost_per_200": _t(gx["cost_cents"], 500.0, 15.0, "Tables 2-3: GPT-4o EXIT"),
        "base_exit_coverage": _t(base_exit_cov, 0.45, 0.01, f"{table}: base EXIT"),
        "base_exit_len": _t(base_exit_len, 1.1, 0.03, f"{table}: base EXIT"),
        "gpt4o_policy_coverage": _t(pol_g[0], 0.4, 0.015, f"{table}: LLM policy GPT-4o"),
        "gpt4o_policy_len": _t(pol_g[1], 0.5, 0.02, f"{table}: LLM policy GPT-4o"),
        "base_policy_coverage": _t(pol_b[0], 0.47, 0.015, f"{table}: LLM policy (base)"),
        "base_policy_len": _t(pol_b[1], 0.2, 0.02, f"{table}: LLM policy (base)"),
    }
    return _finish(tg, sds, margins)


def _mmlu_targets(n: int, g1: float, sds: dict[str, float],
                  margins: dict[str, tuple[float, str]] | None = None) -> dict[str, Target]:
    """As :func:`_hotpot_targets`, with the MMLU choices (Tables 4-5)."""
    table = f"Table {n}"
    gx = published.row(n, "GX")
    tg = _hotpot_targets(n, g1, {})
    tg["unsolvable"] = _t(0.05, 0.22, 0.02, "our choice (multiple choice: few unsolvable; paper silent)")
    tg["cents_per_guide_call"] = _t(0.039, 0.005, 0.0015, "CCPO paper Tables 4-5: ~0.039 c per guide call on MMLU (rows at length ~1)")
    tg["guide_verdict_accuracy"] = _t(0.86, 0.2, 0.04, "our choice (GPT-4o judges 4-option MMLU better than open HotpotQA)")
    tg["gpt4o_exit_coverage"] = _t(gx["coverage"], 0.2, 0.01, "Tables 4-5: GPT-4o EXIT")
    tg["gpt4o_exit_len"] = _t(gx["avg_len"], 0.7, 0.03, "Tables 4-5: GPT-4o EXIT")
    tg["gpt4o_exit_cost_per_200"] = _t(gx["cost_cents"], 60.0, 2.0, "Tables 4-5: GPT-4o EXIT")
    tg["guide_round1_coverage"] = dataclasses.replace(
        tg["guide_round1_coverage"], source=f"{table} and its alpha=0.2 table: UALA/CPO coverage at length 1"
    )
    return _finish(tg, sds, margins)


# Hand-fixed MMLU settings: 4 options (3 wrong), longer questions with options, no tool.
_MMLU_CHAIN = dict(n_wrong=3, p_wrong_geom=0.5)
_MMLU_TOKENS = dict(q_cv=0.35, ans_tokens=3.0, base_system=350.0, base_out=250.0, base_obs=0.0)

# Fitted numbers below: `python -m envs.generators.synthetic --calibrate` (50,000 questions, seed 20251114).
# Each target's sd (per-question standard deviation) was measured on the same run.
PROFILES: dict[str, Profile] = {
    "hotpotqa-llama2": Profile(
        name="hotpotqa-llama2",
        task="hotpotqa",
        base_model="llama-2-7b",
        table="Table 2",
        description="SYNTHETIC HotpotQA, LLaMA-2-7B base + GPT-4o guide, calibrated to Table 2",
        chain=ChainParams(mu_b=-2.6119, mu_g=1.9402, s=2.5328),
        tokens=TokenParams(q_tokens=39.7583),
        exit_gpt4o=ExitParams(e0=1.4879, c0=0.3359, cost_round=1.7301),
        exit_base=ExitParams(e0=0.2353, c0=0.3275),
        policy_gpt4o=PolicyParams(n0=-1.6702, skill=0.5490, n_err=1.5, n_unc=1.0, p_guide=0.6),
        policy_base=PolicyParams(n0=-1.8968, skill=0.4020),
        targets=_hotpot_targets(2, 0.835, {"unsolvable": 0.3, "guide_round1_coverage": 0.3712, "random_coverage": 0.2914, "cents_per_guide_call": 0.0035, "guide_verdict_accuracy": 0.2123, "gpt4o_exit_coverage": 0.289, "gpt4o_exit_len": 1.28, "gpt4o_exit_cost_per_200": 517.5, "base_exit_coverage": 0.476, "base_exit_len": 1.307, "gpt4o_policy_coverage": 0.4143, "gpt4o_policy_len": 0.5572, "base_policy_coverage": 0.4684, "base_policy_len": 0.1766}),
    ),
    "hotpotqa-llama3": Profile(
        name="hotpotqa-llama3",
        task="hotpotqa",
        base_model="llama-3.2-3b",
        table="Table 3",
        description="SYNTHETIC HotpotQA, LLaMA-3.2-3B base + GPT-4o guide, calibrated to Table 3 (and 7)",
        chain=ChainParams(mu_b=-1.8314, mu_g=1.8253, s=2.4260),
        tokens=TokenParams(q_tokens=40.8171),
        exit_gpt4o=ExitParams(e0=1.4901, c0=0.3360, cost_round=1.7301),
        exit_base=ExitParams(e0=0.5007, c0=12.0000),
        policy_gpt4o=PolicyParams(n0=-1.8817, skill=0.8436, n_err=1.5, n_unc=1.0, p_guide=0.6),
        policy_base=PolicyParams(n0=-8.0000, skill=0.1023),
        targets=_hotpot_targets(3, 0.83, {"unsolvable": 0.3, "guide_round1_coverage": 0.3756, "random_coverage": 0.3083, "cents_per_guide_call": 0.0036, "guide_verdict_accuracy": 0.213, "gpt4o_exit_coverage": 0.289, "gpt4o_exit_len": 1.28, "gpt4o_exit_cost_per_200": 517.3, "base_exit_coverage": 0.45, "base_exit_len": 0, "gpt4o_policy_coverage": 0.3571, "gpt4o_policy_len": 0.4713, "base_policy_coverage": 0.4866, "base_policy_len": 0}),
    ),
    "mmlu-llama2": Profile(
        name="mmlu-llama2",
        task="mmlu",
        base_model="llama-2-7b",
        table="Table 4",
        description="SYNTHETIC MMLU, LLaMA-2-7B base + GPT-4o guide, calibrated to Table 4",
        chain=ChainParams(mu_b=-2.8892, mu_g=2.7993, s=2.4240, **_MMLU_CHAIN),
        tokens=TokenParams(q_tokens=103.0289, **_MMLU_TOKENS),
        exit_gpt4o=ExitParams(e0=2.2114, c0=-0.8404, cost_round=0.3763),
        exit_base=ExitParams(e0=0.9426, c0=1.0433),
        policy_gpt4o=PolicyParams(n0=-3.4232, skill=1.0000, n_err=3.0, n_unc=1.0, p_guide=0.7),
        policy_base=PolicyParams(n0=-1.2801, skill=0.3701),
        targets=_mmlu_targets(4, 0.87, {"unsolvable": 0.2179, "guide_round1_coverage": 0.3394, "random_coverage": 0.2494, "cents_per_guide_call": 0.0092, "guide_verdict_accuracy": 0.1826, "gpt4o_exit_coverage": 0.196, "gpt4o_exit_len": 0.7872, "gpt4o_exit_cost_per_200": 73.56, "base_exit_coverage": 0.4073, "base_exit_len": 1.189, "gpt4o_policy_coverage": 0.2897, "gpt4o_policy_len": 0.3425, "base_policy_coverage": 0.4737, "base_policy_len": 0.3459},
            margins={"gpt4o_policy_coverage": (0.03, "model ceiling: with skill 1 at length 1.08 the chain allows ~0.907")}),
    ),
    "mmlu-llama3": Profile(
        name="mmlu-llama3",
        task="mmlu",
        base_model="llama-3.2-3b",
        table="Table 5",
        description="SYNTHETIC MMLU, LLaMA-3.2-3B base + GPT-4o guide, calibrated to Table 5",
        chain=ChainParams(mu_b=-1.3587, mu_g=2.1580, s=1.9834, **_MMLU_CHAIN),
        tokens=TokenParams(q_tokens=105.3197, **_MMLU_TOKENS),
        exit_gpt4o=ExitParams(e0=2.2189, c0=-0.8393, cost_round=0.3763),
        exit_base=ExitParams(e0=1.2002, c0=2.9737),
        policy_gpt4o=PolicyParams(n0=-1.7906, skill=0.8999, n_err=2.0, n_unc=1.0, p_guide=0.7),
        policy_base=PolicyParams(n0=-1.8787, skill=-0.0228),
        targets=_mmlu_targets(5, 0.85, {"unsolvable": 0.2179, "guide_round1_coverage": 0.3583, "random_coverage": 0.2902, "cents_per_guide_call": 0.0094, "guide_verdict_accuracy": 0.1872, "gpt4o_exit_coverage": 0.196, "gpt4o_exit_len": 0.7871, "gpt4o_exit_cost_per_200": 73.56, "base_exit_coverage": 0.3666, "base_exit_len": 0.2641, "gpt4o_policy_coverage": 0.2818, "gpt4o_policy_len": 0.5565, "base_policy_coverage": 0.4936, "base_policy_len": 0.176}),
    ),
}


def get_profile(profile: str | Profile) -> Profile:
    """The profile named ``profile`` (a :class:`Profile` is returned as it is); an unknown name
    raises :class:`CacheError` naming the valid ones."""
    if isinstance(profile, Profile):
        return profile
    if profile not in PROFILES:
        raise CacheError(
            f"unknown synthetic profile {profile!r} (--profile); valid profiles: {', '.join(PROFILES)}"
        )
    return PROFILES[profile]
