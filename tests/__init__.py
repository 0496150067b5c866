"""The tests, by room (docs/testing.md#rooms); shared helpers in tests/helpers.py."""
