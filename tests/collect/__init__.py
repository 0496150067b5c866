"""Tests of data collect and the LLM round protocol."""
