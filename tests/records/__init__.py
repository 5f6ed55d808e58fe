"""Records: rows and phases, their checks and derived values."""
