"""Whole-state invariants and leak checks, and their messages."""
