"""Benchmarks: batchstate's transitions beside a mutable baseline and the bare tensor floor.

Run `python -m benchmarks.step` (see docs/performance.md).
"""
