"""Speculative decoding: verify, sync, windows ahead."""
