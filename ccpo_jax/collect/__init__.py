"""``ccpo-jax data collect``: build response caches from live OpenAI-compatible endpoints.

One job per module:

* :mod:`ccpo_jax.collect.command`   - the command-line flags -> settings, execution, exit status;
* :mod:`ccpo_jax.collect.ladderfile` - ``--ladder FILE``: a base ladder (and guide) in JSON, as the flags it stands for;
* :mod:`ccpo_jax.collect.settings`  - what decides the cache (hashed into it) and how the run goes;
* :mod:`ccpo_jax.collect.collector` - the run: check the output, open the files, the thread pool, finish;
* :mod:`ccpo_jax.collect.rounds`    - one question's calls in the protocol's order and its cache line;
* :mod:`ccpo_jax.collect.caller`    - one call: replay from the call log, or reserve, send, log, count;
* :mod:`ccpo_jax.collect.client`    - one endpoint over httpx (the rules: :mod:`ccpo_jax.llm.wire`);
* :mod:`ccpo_jax.collect.meter`     - dollars spent and reserved against the cap, and the counters;
* :mod:`ccpo_jax.collect.bound`     - the worst-case cost bound printed before the first call;
* :mod:`ccpo_jax.collect.calllog`   - ``OUT.calls``, the call log (flock-ed, fsync-ed);
* :mod:`ccpo_jax.collect.cachefile` - ``OUT``, the cache: manifest, appended lines, resume check, final file;
* :mod:`ccpo_jax.collect.summary`   - the progress bar's line and the summary at the end.

The LLM protocol it speaks (prompts, parsers, the questions file, request bodies, the wire rules) is
:mod:`ccpo_jax.llm`, shared with the gateway. Documentation: ``docs/collect.md``.
"""
