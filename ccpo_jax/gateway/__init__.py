"""``ccpo-jax gateway`` and ``live-eval``: the exported router in front of live endpoints (docs/gateway.md).

An OpenAI-compatible proxy that runs the CCPO protocol per request with data
collect's prompts, parsers and client rules, decides with the exported router,
journals every request as a cache line, and takes feedback for recalibration.
"""
