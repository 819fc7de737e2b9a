"""Benchmarks of loraserve (run as modules, e.g. ``python -m benchmarks.throughput``)."""
