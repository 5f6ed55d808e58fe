"""A forward's inputs, the backends' views of them, hybrid inputs."""
