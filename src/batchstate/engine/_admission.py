"""The default admission count: which waiting requests to try in the next extend or mix.

Pure host arithmetic over lengths: first come, first served, under the
running-request cap, the free request slots, a prefill-token budget per
extend, and the free KV tokens less a reserve for the decode growth of
everything running. The reserve is an estimate; when decode outgrows it
anyway, the engine retracts (`_decode.decode_rows`). `FirstComeFirstServed`,
the default scheduler policy, admits by `choose`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import final

import attrs

from batchstate import Req

__all__ = ["Budget", "choose", "reserve"]


@final
@attrs.frozen
class Budget:
    """What the next extend may take.

    Args:
        num_rows: request rows free (slots, and the running cap).
        num_free_tokens: KV tokens the pools can hand out: free, plus cached pages eviction frees.
        reserved_tokens: KV tokens held back for the running requests' growth.
        max_prefill_tokens: input ids one extend may compute (at least one request goes).
        page_size: KV tokens per page; a request's prompt costs whole pages.
        new_token_ratio: share of a request's remaining output held back for it.
        headroom_pages: pages held back per request for its next decode steps.
        anything_running: False lets the first request skip the reserve, so an
            empty engine always admits.
    """

    num_rows: int
    num_free_tokens: int
    reserved_tokens: float
    max_prefill_tokens: int
    page_size: int
    new_token_ratio: float
    headroom_pages: int
    anything_running: bool


def choose(waiting: Iterable[Req], remaining: Iterable[int], budget: Budget) -> int:
    """How many requests from the front of `waiting` to try in one extend.

    Args:
        waiting: the queue, front first.
        remaining: output tokens each waiting request may still generate, in queue order.

    >>> budget = Budget(8, 64, 0.0, 1024, 16, 0.5, 1, anything_running=True)
    >>> choose([Req(0, (1,) * 20), Req(1, (1,) * 20)], [8, 8], budget)
    1
    """
    page = budget.page_size
    tokens_left = budget.num_free_tokens - budget.reserved_tokens
    prefill_left = budget.max_prefill_tokens
    chosen = 0
    for req, left in zip(waiting, remaining, strict=False):
        if chosen == budget.num_rows:
            break
        num_input = len(req.input_ids)
        # Whole pages for the prompt, pages of headroom, a share of the output.
        headroom = budget.headroom_pages * page
        cost = -(-num_input // page) * page + headroom + budget.new_token_ratio * left
        first_alone = chosen == 0 and not budget.anything_running
        if not first_alone and (cost > tokens_left or (chosen and num_input > prefill_left)):
            break
        chosen += 1
        tokens_left -= cost
        prefill_left -= num_input
    return chosen


def reserve(
    remaining: Iterable[int], page_size: int, new_token_ratio: float, headroom_pages: int
) -> float:
    """KV tokens to hold back for running requests: headroom pages and a share of their output."""
    return sum(headroom_pages * page_size + new_token_ratio * left for left in remaining)
