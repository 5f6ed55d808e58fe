"""The scheduler policy: which requests go first, how many fit, whom decode retracts.

The policy decides; the engine's bookkeeping (`EngineState` and the step's
stages) carries the decision out through batchstate's transitions. An
adopter swaps the policy (`Engine(..., policy=...)`) without touching the
bookkeeping: any object with these four methods will do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, final

import attrs

from batchstate import Req
from batchstate.engine._admission import Budget, choose
from batchstate.engine._config import EngineConfig

__all__ = ["FirstComeFirstServed", "SchedulerPolicy"]


class SchedulerPolicy(Protocol):
    """What a scheduler decides at each step; every method is pure host arithmetic."""

    def order(self, waiting: Sequence[Req]) -> Sequence[Req]:
        """The waiting queue in admission order, front first (`waiting` itself: unchanged).

        A retracted request is queued at the front, to go again first; the
        policy sees it there and may move it.
        """
        ...

    def admit(self, waiting: Iterable[Req], remaining: Iterable[int], budget: Budget) -> int:
        """How many requests from the front of the ordered queue to try in this step.

        `remaining[i]`: output tokens `waiting[i]` may still generate. The
        engine tries that many and, when the pools refuse, as many as the
        refusal's `fits` says.
        """
        ...

    def victim(self, rids: Sequence[int], remaining: Sequence[int]) -> int:
        """The running row decode retracts when the KV pool runs out (a row index).

        `rids` and `remaining` are the running rows', in row order (oldest
        admission first); at least two rows run.
        """
        ...

    def chunk_budget(self, config: EngineConfig) -> int:
        """Prompt tokens one chunked or mixed step may compute."""
        ...


@final
@attrs.frozen
class FirstComeFirstServed:
    """SGLang's default: queue order, `choose`'s budget, the newest row retracted first.

    >>> FirstComeFirstServed().victim([4, 7, 9], [3, 30, 2])
    2
    """

    def order(self, waiting: Sequence[Req]) -> Sequence[Req]:
        """The queue as it stands: arrival order, retracted requests in front."""
        return waiting

    def admit(self, waiting: Iterable[Req], remaining: Iterable[int], budget: Budget) -> int:
        """As many as `choose` lets into `budget`."""
        return choose(waiting, remaining, budget)

    def victim(self, rids: Sequence[int], remaining: Sequence[int]) -> int:
        """The newest row: the oldest keep going and finish first."""
        return len(rids) - 1

    def chunk_budget(self, config: EngineConfig) -> int:
        """`chunk_size`, or with whole prompts the prefill cap."""
        return config.chunk_size or config.max_prefill_tokens
