"""Benchmarks: `make bench` runs them all, `make bench BENCH=<name>` one (bench/<name>.py)."""
