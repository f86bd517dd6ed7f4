"""Benchmarks (see BENCHMARKS.md)."""
