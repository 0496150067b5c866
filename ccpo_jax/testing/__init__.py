"""Test support that ships with the package (as ``starlette.testclient``): the scripted
chat-completions server (``chat_server``, also ``python -m ccpo_jax.testing.chat_server N``), the
gateway on a free port (``gateway_harness``), the designed llama-server models (``llama_server``,
``python -m ccpo_jax.testing.llama_server record ...``) and a real ``redis-server`` (``redis_server``).

Used by tests/ and benchmarks/; nothing else in ccpo_jax imports it (pyproject's import-linter
contract). pytest is no runtime dependency: only the function that skips imports it.
"""
