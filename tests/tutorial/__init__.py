"""Tests of ``mpstream.tutorial``."""
