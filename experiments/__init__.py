"""Experiment settings: one per table of the CCPO paper (``experiments.settings``)."""
