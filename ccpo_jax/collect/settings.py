"""What a collection is (:class:`Settings`, hashed into the cache) and how it runs (:class:`Execution`)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.llm import protocols
from ccpo_jax.llm.calls import TOP_LOGPROBS, CallDefaults
from ccpo_jax.llm.provenance import COLLECTOR_VERSION
from ccpo_jax.llm.wire import Endpoint, RetryPolicy

ROLES = ("base", "guide")


class CollectError(UserError):
    """The run could not go on (endpoint failure, bad resume); finished questions are kept."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides the cache's content. Hashed into the manifest: a ``--resume``
    must use the same settings (execution options such as concurrency may change)."""

    T: int
    base: Endpoint
    guide: Endpoint | None  # None: a guide-less cascade (no guide call; docs/collect.md)
    prices: dict[str, tuple[float, float]]  # role -> (USD per M input tokens, per M output tokens)
    price_sources: dict[str, str]
    questions_file: str
    questions_sha256: str
    base_max_tokens: int = 512
    guide_max_tokens: int = 32
    decision_max_tokens: int = 8
    base_temperature: tuple[float, float] = CallDefaults.base_temperature  # first round, later rounds
    guide_temperature: float = CallDefaults.guide_temperature
    seed: int | None = CallDefaults.seed
    logprobs: bool = CallDefaults.logprobs
    f1_threshold: float | None = None
    exit_roles: tuple[str, ...] = ()
    policy_roles: tuple[str, ...] = ()
    policy_coverage: float = 0.9
    name: str = "collected"
    task: str = "unknown"
    license: str = "unknown"
    #: A base ladder (docs/collect.md#a-ladder-of-base-models): round t's base model is ``ladder[t]`` (T entries,
    #: ``ladder[0]`` is ``base``), priced as role ``base@<t+1>``; empty: ``base`` every round.
    ladder: tuple[Endpoint, ...] = ()
    #: The round protocol (:mod:`ccpo_jax.llm.protocols`): ``json`` (structured replies, the default)
    #: or ``paper`` (the paper's free text).
    protocol: str = protocols.DEFAULT

    @property
    def proto(self) -> "protocols.Protocol":
        return protocols.get(self.protocol)

    @property
    def cascade(self) -> bool:
        """A guide-less cascade: each round is its base call alone (``models.guide: null``)."""
        return self.guide is None

    def roles(self) -> tuple[str, ...]:
        """The priced roles: ``base`` (or ``base@1`` ... ``base@T`` on a ladder) and ``guide`` (none in
        a cascade)."""
        bases = tuple(f"base@{t + 1}" for t in range(self.T)) if self.ladder else ("base",)
        return bases if self.cascade else bases + ("guide",)

    def base_role(self, t: int) -> str:
        """The role of round t's (0-based) base call."""
        return f"base@{t + 1}" if self.ladder else "base"

    def endpoint(self, role: str) -> Endpoint:
        if role.startswith("base@"):
            return self.ladder[int(role[5:]) - 1]
        return self.base if role == "base" else self.guide

    @property
    def top_logprobs(self) -> int | None:
        """The ``top_logprobs`` sent with ``logprobs`` (None when log-probs are not asked for)."""
        return TOP_LOGPROBS if self.logprobs else None

    def max_tokens(self) -> dict[str, int]:
        if self.cascade:  # (no guide call: its settings are not part of the collection)
            return {"base": self.base_max_tokens, "decisions": self.decision_max_tokens}
        return {"base": self.base_max_tokens, "guide": self.guide_max_tokens, "decisions": self.decision_max_tokens}

    def guide_requests(self) -> dict[str, float]:
        """The guide's request settings for the manifest and the hash (none in a cascade)."""
        return {} if self.cascade else {"guide_temperature": self.guide_temperature}

    def endpoints(self) -> dict[str, dict[str, str]]:
        """role -> {url, model}: endpoints by public URL (no key variables)."""
        return {r: {"url": self.endpoint(r).public_url, "model": self.endpoint(r).model} for r in self.roles()}

    def hashed(self) -> dict[str, Any]:
        """The settings as JSON (endpoints by public URL and model; key variables not included)."""
        return {
            "T": self.T,
            "endpoints": self.endpoints(),
            "prices": {r: list(self.prices[r]) for r in self.roles()},
            "questions_sha256": self.questions_sha256,
            "max_tokens": self.max_tokens(),
            "base_temperature": list(self.base_temperature),
            **self.guide_requests(),
            "seed": self.seed,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "f1_threshold": self.f1_threshold,
            "exit_roles": list(self.exit_roles),
            "policy_roles": list(self.policy_roles),
            "policy_coverage": self.policy_coverage,
            "prompts": self.proto.prompt_hashes(),
            # (absent for the paper's protocol: the hashes of caches collected before the field stay)
            **({} if self.protocol == "paper" else {"protocol": self.protocol}),
            "collector_version": COLLECTOR_VERSION,
            "name": self.name,
            "task": self.task,
            "license": self.license,
        }

    def config_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.hashed(), sort_keys=True).encode()).hexdigest()

    def model_names(self, roles: tuple[str, ...]) -> list[str]:
        out: list[str] = []
        for r in roles:
            m = self.endpoint(r).model
            if m not in out:
                out.append(m)
        return out


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the run goes (not part of the cache): concurrency, retries, budget, output."""

    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()
    max_cost_usd: float | None = None
    progress: bool = True
    limit: int | None = None
    resume: bool = False
    dry_run: bool = False
    allow_unlisted_model: bool = False  # call a model its endpoint's GET /models does not list
