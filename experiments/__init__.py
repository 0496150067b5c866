"""Runnable experiments built on the library (``python -m experiments.<name>``); the library never imports this package."""
