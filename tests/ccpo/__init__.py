"""Tests of the method: training, rows, presets, reports, sweeps, the learning proof."""
