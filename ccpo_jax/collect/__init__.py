"""``ccpo-jax data collect``: build response caches from live OpenAI-compatible endpoints.

* :mod:`ccpo_jax.collect.client`    - one endpoint over httpx: retries, backoff, Retry-After;
* :mod:`ccpo_jax.collect.protocol`  - the CCPO base-guide rounds: prompts, parsers, measures;
* :mod:`ccpo_jax.collect.questions` - the questions file (JSONL or CSV: id, question, gold);
* :mod:`ccpo_jax.collect.collector` - the resumable, budgeted, concurrent run;
* :mod:`ccpo_jax.collect.command`   - the command-line flags.

Documentation: ``docs/collect.md``.
"""
