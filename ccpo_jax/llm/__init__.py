"""The LLM protocol: what data collect and the gateway both say to an OpenAI-compatible endpoint.

One job per module:

* :mod:`ccpo_jax.llm.paper`      - the paper's base-guide rounds: prompts, parsers, measures, messages;
* :mod:`ccpo_jax.llm.structured` - the JSON round protocol's schemas and readers;
* :mod:`ccpo_jax.llm.protocols`  - the round protocols by name (``json``, ``paper``), as in a cache's provenance;
* :mod:`ccpo_jax.llm.calls`      - one call's request body, the per-call defaults, the token reservation;
* :mod:`ccpo_jax.llm.wire`       - the endpoint, replies, retries and bounded reads (rules without I/O);
* :mod:`ccpo_jax.llm.questions`  - the questions file (JSONL or CSV: id, question, gold);
* :mod:`ccpo_jax.llm.provenance` - the collector's version and the (reproducible) date.

Layer: below ``collect`` and ``gateway`` (pyproject.toml; the gateway imports no ``collect``).
Documentation: ``docs/collect.md``, ``docs/gateway.md``.
"""
