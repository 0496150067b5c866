"""The generators: SYNTHETIC caches, never LLM outputs (docs/caches.md, docs/results.md).

- :mod:`envs.generators.synthetic`: caches calibrated to the CCPO paper's marginals, with their
  calibrated profiles in :mod:`envs.generators.synthetic_profiles`;
- :mod:`envs.generators.oracle`: hand-designed caches whose best observable policy is known.

Builds on :mod:`envs.cache`, :mod:`envs.replay` (the oracles' observation classes) and
:mod:`envs.published` (the calibration targets).
"""
