"""The algorithm's pure JAX maths, no I/O: V-trace (:mod:`.vtrace`), the conformal set, kappa
and softmask (:mod:`.conformal`), the coverage surrogate (:mod:`.constraint`), the CPO
trust-region step (:mod:`.trust_region`), the replay-exact estimator (:mod:`.exact`) and the
networks (:mod:`.networks`). Imports nothing of ``ccpo_jax`` outside this folder."""
