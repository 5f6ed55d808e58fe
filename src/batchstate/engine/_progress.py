"""Progress on stderr for a long run: one tqdm bar per phase (engine, oracle), with an ETA.

Where stderr is not a terminal (CI, `| tee`, a log file), bars would be
carriage-return noise or nothing: `PlainProgress` prints a plain line every
few seconds instead (`progress_for` picks).
"""

from __future__ import annotations

from time import monotonic
from typing import Final, Never, Protocol, TextIO, final

from tqdm import tqdm

__all__ = ["PLAIN_EVERY_S", "PlainProgress", "Progress", "ProgressReport", "progress_for"]

PLAIN_EVERY_S: Final = 5.0  # seconds between plain progress lines


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


@final
class PlainProgress:
    """Progress as plain lines (`engine: 120/256 requests, 4 s`), at most one per `every_s`.

    The first report of each phase and its last (`done == total`) always print.

    >>> import io
    >>> stream = io.StringIO()
    >>> progress = PlainProgress(stream, every_s=3600.0)
    >>> for done in (0, 1, 2, 2):
    ...     progress("engine", done, 2)
    >>> print(stream.getvalue().replace("0 s", "T"), end="")
    engine: 0/2 requests, T
    engine: 2/2 requests, T
    """

    def __init__(self, stream: TextIO, *, every_s: float = PLAIN_EVERY_S) -> None:
        self.stream, self.every_s = stream, every_s
        self.phase = ""
        self.started = self.printed = 0.0
        self.done = -1  # the count last printed

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Print `done` of `total` through `phase`, if the last line is old enough."""
        now = monotonic()
        if phase != self.phase:
            self.phase, self.started, self.printed, self.done = phase, now, now - self.every_s, -1
        if done == self.done:
            return  # a phase may report its end twice
        if done == total or now - self.printed >= self.every_s:
            self.printed, self.done = now, done
            print(f"{phase}: {done}/{total} requests, {now - self.started:.0f} s", file=self.stream)
            self.stream.flush()

    def close(self) -> None:
        """Nothing to end: each line is whole."""


class ProgressReport(Protocol):
    """What `simulate` reports to, and what the command closes at the end."""

    def __call__(self, phase: str, done: int, total: int) -> None: ...

    def close(self) -> None: ...


def progress_for(stream: TextIO, *, enabled: bool) -> ProgressReport:
    """Bars on a terminal, plain lines elsewhere, nothing when not `enabled`."""
    if not enabled:
        return Progress(stream, enabled=False)
    if stream.isatty():
        return Progress(stream, enabled=True)
    return PlainProgress(stream)
