"""Imported at start-up by each Python process `batchstate.sglang.launch` starts."""

from batchstate.sglang._hook import install_from_environment

install_from_environment()
