"""A small progress bar on stderr, for long runs at a terminal."""

from __future__ import annotations

from time import monotonic
from typing import TextIO, final

__all__ = ["Progress"]


@final
class Progress:
    """`[#####.....] 128/256 requests  3.1 s`, redrawn in place at most ten times a second.

    Draws nothing when `enabled` is False (not a terminal, or JSON output).

    >>> import io
    >>> stream = io.StringIO()
    >>> bar = Progress(4, stream, enabled=True, width=4)
    >>> bar.update(2)
    >>> bar.close()
    >>> stream.getvalue().split("\\r")[-1].split("  ")[0]
    '[####] 4/4 requests'
    """

    def __init__(self, total: int, stream: TextIO, *, enabled: bool, width: int = 30) -> None:
        self.total, self.stream, self.enabled, self.width = total, stream, enabled, width
        self.start = monotonic()
        self.last_draw = float("-inf")

    def update(self, done: int) -> None:
        """Redraw for `done` finished requests, if a tenth of a second has passed."""
        now = monotonic()
        if self.enabled and now - self.last_draw >= 0.1:
            self.last_draw = now
            self._draw(done, now)

    def close(self) -> None:
        """Draw the full bar and end its line."""
        if self.enabled:
            self._draw(self.total, monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, done: int, now: float) -> None:
        filled = self.width * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} requests  {now - self.start:.1f} s")
        self.stream.flush()
