"""Tests of ``mpstream.doctor``."""
