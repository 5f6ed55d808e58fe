"""The summary on stdout, as a table or as JSON, and the line naming a failed check."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Protocol, TypeVar

import attrs

from batchstate.engine import Summary

__all__ = ["failed_check", "print_summary"]


class _Checked(attrs.AttrsInstance, Protocol):
    @property
    def ok(self) -> bool: ...


S = TypeVar("S", bound=_Checked)


def print_summary(summary: S, render: Callable[[S], str], *, as_json: bool) -> None:
    """Print `summary` with `render`, or as one JSON object (its fields and `ok`)."""
    if as_json:
        print(json.dumps({**attrs.asdict(summary), "ok": summary.ok}, indent=2))
    else:
        print(render(summary), flush=True)


def failed_check(summary: Summary) -> str:
    """The first check that failed, in words."""
    if summary.oracle_passed is False:
        return f"the oracle: {summary.oracle}"
    if not summary.pools_conserved:
        return f"pool conservation: {summary.pools}"
    return f"device reads: {summary.device_reads} on the decode path, expected none"
