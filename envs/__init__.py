"""Response caches (schema, formats, validation, synthetic generators, importers)
and the replay environments. Knows nothing of ``ccpo_jax``."""
from envs.cache import (  # noqa: F401
    A_BASE,
    A_GUIDE,
    A_NEXT,
    ACTION_NAMES,
    N_ACTIONS,
    CacheError,
    Manifest,
    ModelInfo,
    ResponseCache,
    load_fast,
    save_fast,
)
from envs.formats import load_cache, save_cache  # noqa: F401
