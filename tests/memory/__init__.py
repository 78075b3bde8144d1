"""Tests of ``mpstream.memory``."""
