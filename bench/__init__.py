"""Benchmarks run by `make bench` (timing goals live here, not in unit tests)."""
