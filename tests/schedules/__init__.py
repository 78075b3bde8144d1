"""Tests of ``mpstream.schedules``."""
