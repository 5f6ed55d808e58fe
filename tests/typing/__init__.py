"""What mypy accepts and rejects."""
