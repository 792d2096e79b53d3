"""Benchmarks against the peers; used by the `flash-dma bench` command and bench/ scripts."""
