"""The command's exit codes and the name its messages start with."""

from __future__ import annotations

from typing import Final

__all__ = ["EXIT_CODES", "FAILED", "OK", "PROG", "USAGE"]

OK, FAILED, USAGE = 0, 1, 2
EXIT_CODES: Final = (
    (OK, "the run finished and every check passed"),
    (
        FAILED,
        "a check failed (the oracle, an invariant, pool conservation or device reads),"
        " or a data-parallel rank failed",
    ),
    (
        USAGE,
        "a usage error: a missing command, a bad or contradictory option, a bad --plot path,"
        " a run too big for this machine's memory",
    ),
)
PROG: Final = "batchstate simulate"
