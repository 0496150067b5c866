"""Tests of the replay env, the caches and importers, the field's APIs (gymnax, Jumanji)."""
