"""The docs: every block runs, every public name is documented, the benchmarks run."""
