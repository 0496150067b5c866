"""Resource-governance substrate for the Stackelberg method (arXiv 2606.23026).

- :mod:`envs.governance.grid`: the response grid (schema, human JSONL and fast formats, validation).
- :mod:`envs.governance.synthetic`: a SYNTHETIC grid calibrated to the paper's probes (§10.3, Table 6).
- :mod:`envs.governance.session`: the functional jit/vmap multi-turn session environment.
"""
