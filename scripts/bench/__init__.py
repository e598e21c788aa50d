"""Benchmarks, each run from the repository root as `python -m scripts.bench.NAME`."""
