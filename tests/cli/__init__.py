"""Tests of ``mpstream.cli``."""
