"""Progress on stderr for a long run: one tqdm bar per phase (engine, oracle), with an ETA."""

from __future__ import annotations

from typing import Never, TextIO, final

from tqdm import tqdm

__all__ = ["Progress"]


@final
class Progress:
    """Call it with `(phase, done, total)`; each new phase closes the last bar and opens one.

    A bar's clock starts when its phase reports first (`simulate` reports
    `done=0` right before the phase's work), so model set-up and warm-up
    are not counted, and the oracle gets its own bar and ETA instead of
    freezing a finished one. Draws nothing when `enabled` is False.

    >>> import io
    >>> stream = io.StringIO()
    >>> progress = Progress(stream, enabled=True)
    >>> for done in range(3):
    ...     progress("engine", done, 2)
    >>> progress("oracle", 2, 2)
    >>> progress.close()
    >>> [line.split("\\r")[-1].split("|")[0] for line in stream.getvalue().split("\\n")]
    ['engine: 100%', 'oracle: 100%', '']
    """

    def __init__(self, stream: TextIO, *, enabled: bool) -> None:
        self.stream, self.enabled = stream, enabled
        self.phase = ""
        self.bar: tqdm[Never] | None = None  # Never: a bar over no iterable

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Show `done` of `total` requests through `phase`."""
        if not self.enabled:
            return
        bar = self.bar
        if bar is None or phase != self.phase:
            self.close()
            self.phase = phase
            bar = tqdm(
                desc=phase, total=total, unit="req", file=self.stream, mininterval=0.1, leave=True
            )
            self.bar = bar
        bar.update(done - bar.n)

    def close(self) -> None:
        """End the current bar's line, if one is open."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
