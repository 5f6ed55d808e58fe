"""The reference engine: modes, oracle, data-parallel ranks, summaries."""
