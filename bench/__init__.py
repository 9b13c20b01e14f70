"""Benchmarks; a package so tests can reuse their evaluation code (tests/kv/test_quality.py)."""
