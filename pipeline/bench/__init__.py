"""Benchmarks against what users would pick instead (`+job=bench`, `+job=bench_quick`)."""
