"""The CCPO method (arXiv 2511.11828) and ``ccpo-jax reproduce``: the trainer's configuration
(:mod:`.config`, :mod:`.presets`), the paper's settings and splits, Algorithm 1
(:mod:`.train`), the members, evaluation and saved policies, the learned and non-learned rows,
the report, :func:`.reproduce.reproduce`, and the router export (:mod:`.export`)."""
