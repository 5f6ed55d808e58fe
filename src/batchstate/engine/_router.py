"""Which rank runs each request: a rule every rank applies to the same facts."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import final

from batchstate.engine._workload import RequestSpec

__all__ = ["Router"]


@final
class Router:
    """Sends each arriving request to the least-loaded rank (ties: the lowest rank).

    A follow-up turn goes where its conversation ran: that rank holds the
    earlier turn's answer (and, with a prefix cache, its KV). Every rank
    runs its own `Router` over the same workload and the same exchanged
    loads, so all agree on every assignment without sending one.

    >>> from batchstate.engine._workload import RequestSpec
    >>> router = Router([RequestSpec(rid, 0, (1, 2), 4) for rid in range(3)], num_ranks=2)
    >>> [(rank, spec.rid) for rank, spec in router.route(0, loads=(1, 0))]
    [(1, 0), (0, 1), (1, 2)]
    """

    def __init__(self, specs: Iterable[RequestSpec], num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._pending = deque(sorted(specs, key=lambda spec: spec.arrival_step))
        self._rank_of: dict[int, int] = {}

    @property
    def done(self) -> bool:
        """Whether every request has been routed."""
        return not self._pending

    @property
    def next_arrival(self) -> int:
        """The arrival step of the next request to route (call only when not `done`)."""
        return self._pending[0].arrival_step

    def route(self, clock: int, loads: Sequence[int]) -> list[tuple[int, RequestSpec]]:
        """`(rank, spec)` for each request arriving by step `clock`, in arrival order.

        `loads`: the requests each rank held at the last exchange; each
        assignment here adds one to its rank's load.
        """
        loads = list(loads)
        routed = []
        while self._pending and self._pending[0].arrival_step <= clock:
            spec = self._pending.popleft()
            if spec.follows is not None:
                rank = self._rank_of[spec.follows]
            else:
                rank = min(range(self.num_ranks), key=loads.__getitem__)
            loads[rank] += 1
            self._rank_of[spec.rid] = rank
            routed.append((rank, spec))
        return routed
