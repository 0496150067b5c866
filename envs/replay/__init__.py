"""The replay stage: what a policy can do with a cache (docs/environment.md).

- :mod:`envs.replay.env`: the jit/vmap replay environment of the base/guide orchestration POMDP;
- :mod:`envs.replay.gymnax`: the same env as a gymnax ``Environment`` (optional extra ``gymnax``; docs/gym_api.md);
- :mod:`envs.replay.features`: the observation features;
- :mod:`envs.replay.bound`: the clairvoyant bound (cheapest cost when every answer is known);
- :mod:`envs.replay.reference`: the plain-Python reference of the env and evaluator (the tests' oracle);
- :mod:`envs.replay.report`: the statistics of ``ccpo-jax data check`` (they include the bound).

Builds on :mod:`envs.cache` only.
"""
