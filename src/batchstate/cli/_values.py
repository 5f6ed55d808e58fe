"""Option values that argparse's own types do not parse; each error names the option's parts.

argparse reports a type's failure as `invalid <function name> value`, so each
parser here raises its own message instead: the user sees no private name.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["FaultArgs", "SharedPrefix", "Switch", "fault", "plot_path"]


class Switch(argparse.BooleanOptionalAction):
    """A mode the run has on or off, in two forms (`--overlap` and `--no-overlap`, say).

    Either form names the setting explicitly, the default too; the last one given wins.

    Its help says which is the default in words (`on by default`): argparse's
    own would add `(default: True)`, which reads as a value the flag takes.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, default: bool, help: str
    ) -> None:
        super().__init__(option_strings, dest, default=default)
        self.help = help


class SharedPrefix(argparse.Action):
    """`--shared-prefix COUNT LEN FRACTION`: two whole numbers and a share, as a tuple."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list) and len(values) == 3  # nargs=3
        count, length, fraction = (str(value) for value in values)
        parsed = (
            self._whole("COUNT", count),
            self._whole("LEN", length),
            self._number("FRACTION", fraction),
        )
        setattr(namespace, self.dest, parsed)

    def _whole(self, part: str, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentError(
                self, f"{part} must be a whole number, got {text!r}"
            ) from None

    def _number(self, part: str, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentError(self, f"{part} must be a number, got {text!r}") from None


class FaultArgs(NamedTuple):
    """`--dp-fault`, parsed: the engine's `Fault` is built from it for the run."""

    rank: int
    step: int
    hang: bool


def fault(text: str) -> FaultArgs:
    """`RANK:STEP` raises there; `RANK:STEP:hang` stops answering there."""
    parts = text.split(":")
    hang = parts[2:] == ["hang"]
    try:
        if len(parts) == 2 or hang:
            return FaultArgs(int(parts[0]), int(parts[1]), hang)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK:STEP or RANK:STEP:hang, got {text!r}")


def plot_path(text: str) -> Path:
    """A file to plot to; `Path("")` would be the current folder, so an empty one is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; give a file name such as run.png")
    return Path(text)
