"""Tests of ``mpstream.stages``."""
