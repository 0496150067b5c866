"""Tests of the Stackelberg governance game and its learners."""
