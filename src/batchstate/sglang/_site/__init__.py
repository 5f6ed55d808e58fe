"""Holds the `sitecustomize` that `batchstate.sglang.launch` puts on PYTHONPATH."""
