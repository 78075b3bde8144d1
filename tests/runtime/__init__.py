"""Tests of ``mpstream.runtime``."""
