"""Tests of the maths against its oracles: conformal calibration, guarantees, CPO's trust region, V-trace."""
