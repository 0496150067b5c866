"""Tests of whole runs of the CLI, several processes and devices, CI."""
