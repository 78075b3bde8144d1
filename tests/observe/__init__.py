"""Tests of ``mpstream.observe``."""
