"""What every collected file says about its maker: the collector's version and the date
(``SOURCE_DATE_EPOCH`` honoured), shared by data collect's caches and the gateway's journal."""
from __future__ import annotations

import datetime as dt
import os

#: Version of the collector's protocol and output (in every cache's provenance).
COLLECTOR_VERSION = "1"


def today() -> str:
    """UTC date (``SOURCE_DATE_EPOCH`` when set, for reproducible files)."""
    sde = os.environ.get("SOURCE_DATE_EPOCH")
    if sde and sde.strip().isdigit():
        return dt.datetime.fromtimestamp(int(sde), dt.timezone.utc).date().isoformat()
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def collector_version() -> str:
    import ccpo_jax

    return f"ccpo-jax {ccpo_jax.__version__}, collector {COLLECTOR_VERSION}"
