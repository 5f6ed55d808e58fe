"""Render the transition table for the docs, from the same data the tests walk."""

from __future__ import annotations

from collections.abc import Iterable

from batchstate._transitions import TRANSITIONS, Transition

__all__ = ["render_transitions"]

_HEADER = (
    "| from phase | transition | with | failure (`Failure`) | raises | to phase |",
    "|---|---|---|---|---|---|",
)


def render_transitions(table: Iterable[Transition] = TRANSITIONS) -> str:
    """The transition table as a Markdown table, one row per transition.

    >>> print(render_transitions()[:60])
    | from phase | transition | with | failure (`Failure`) | rai
    """
    lines = [*_HEADER]
    for row in table:
        cells = (
            _name(row.source) if row.source else "—",
            f"`{row.function.__name__}`",
            _name(row.operand) if row.operand else "",
            ", ".join(_name(kind) for kind in row.failures),
            ", ".join(_name(kind) for kind in row.raises),
            _name(row.target),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _name(kind: type) -> str:
    return f"`{kind.__name__}`"
