"""Tests of ``mpstream.pipe``."""
