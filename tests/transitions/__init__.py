"""The transitions, one by one, and the transition table."""
