"""Tests of the exported router and the server."""
