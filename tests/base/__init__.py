"""Base values: mirrored pairs, read-only host arrays, results and unwrap, the public face."""
