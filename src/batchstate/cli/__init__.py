"""The `batchstate` command: `batchstate simulate` runs the reference engine on a workload.

By concern: `_parser` and `_option_groups` declare the options, `_values`
parses their values, `_checks` builds the run's configs and checks them,
`_run` runs the engine and `_output` prints the summary. Everything up to
the checks loads no torch, so the help, the version and every usage error
answer at once; `_run` loads torch and the engine.
"""

from batchstate.cli._codes import EXIT_CODES
from batchstate.cli._main import main

__all__ = ["EXIT_CODES", "main"]
