"""Tests of ``mpstream.capture``."""
