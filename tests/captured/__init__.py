"""Captured forwards: padding and graph buffers."""
