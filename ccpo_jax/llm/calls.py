"""One protocol call's request, shared by data collect and the gateway: the body sent
(:func:`request_body`, which the call log's ``request_key`` hashes), the per-call defaults
(:class:`CallDefaults`) and the worst-case prompt-token reservation (:func:`reserve_tokens`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

#: ``top_logprobs`` sent with ``logprobs``: llama-cpp-python returns no log-probs for ``logprobs``
#: alone, and every OpenAI-compatible server we know accepts it (OpenAI: 0-20); 1 is the fewest
#: alternatives that make the common servers return the chosen tokens' log-probs.
TOP_LOGPROBS = 1

#: Prompt tokens per character assumed by the cost bound before a model has replied.
PROMPT_TOKENS_PER_CHAR = 0.5
#: Tokens added per chat message by the bound (chat template overhead).
TOKENS_PER_MESSAGE = 16


@dataclasses.dataclass(frozen=True)
class CallDefaults:
    """The per-call defaults (one definition): data collect's :class:`ccpo_jax.collect.settings.Settings`
    and the gateway's ``ProtocolConfig`` both read them."""

    base_temperature: tuple[float, float] = (0.0, 1.0)  # first round, later rounds (paper, MMLU)
    guide_temperature: float = 0.0
    seed: int | None = 0
    logprobs: bool = True


def reserve_tokens(chars: int, n_messages: int, ratio: float = PROMPT_TOKENS_PER_CHAR) -> int:
    """A worst-case reservation of prompt tokens before a model has replied: ``ratio`` tokens per
    character (default :data:`PROMPT_TOKENS_PER_CHAR`) plus :data:`TOKENS_PER_MESSAGE` a message."""
    return math.ceil(chars * ratio) + TOKENS_PER_MESSAGE * n_messages


def request_body(model: str, messages: list[dict], max_tokens: int, temperature: float, seed: int | None,
                 logprobs: bool, response_format: dict | None = None) -> dict:
    """The chat-completions body of one protocol call (data collect and the gateway send the same);
    ``response_format``: the structured protocol's JSON schema (None: not sent)."""
    b: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    if response_format is not None:
        b["response_format"] = response_format
    if seed is not None:
        b["seed"] = seed
    if logprobs:
        b["logprobs"] = True
        b["top_logprobs"] = TOP_LOGPROBS
    return b
