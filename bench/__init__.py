"""Benchmarks; a package so tests can reuse their evaluation code (tests/test_kv_quality.py)."""
