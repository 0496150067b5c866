"""The data side, by stage (docs/architecture.md); knows nothing of ``ccpo_jax``.

- :mod:`envs.cache`: the response cache (schema, both formats, value rules, atomic writes);
- :mod:`envs.replay`: the replay environment (env, features, clairvoyant bound, plain-Python reference);
- :mod:`envs.generators`: SYNTHETIC caches (calibrated generator, oracle caches);
- :mod:`envs.importers`: public cached LLM responses -> caches (and the list prices);
- :mod:`envs.governance`: the Stackelberg response grid and session environment;
- :mod:`envs.published`: the papers' published numbers.

Stages import downwards only: importers, generators, governance above replay above cache
and published (pyproject's import-linter contracts).
"""
from envs.cache.schema import (  # noqa: F401
    A_BASE,
    A_GUIDE,
    A_NEXT,
    ACTION_NAMES,
    N_ACTIONS,
    CacheError,
    Manifest,
    ModelInfo,
    ResponseCache,
)
from envs.cache.fast import load_fast, save_fast  # noqa: F401
from envs.cache.formats import load_cache, save_cache  # noqa: F401
