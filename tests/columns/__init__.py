"""Column sets: declarations, packing, checks, values."""
