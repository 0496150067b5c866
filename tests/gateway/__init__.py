"""Tests of the OpenAI-compatible gateway in front of scripted and real upstreams."""
