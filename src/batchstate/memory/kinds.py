"""The kinds of memory a model's layers keep, described once, when the pools are made.

Full-attention layers keep every token's KV in pages (the pools' page
list and token table). A hybrid model also has layers of other kinds:

- `SlidingWindow`: attention over the last `window` positions only; their
  KV lives in window pages of their own, and a row gives back the pages
  that fall wholly outside its window as it grows;
- `RecurrentState`: a state-space or linear-attention layer keeps one
  fixed-size state per request instead of KV: one state slot per live
  request, taken and given back with its request slot.

`MemoryKinds()` (`FULL_ATTENTION`) describes a full-attention model: pools
made with it are exactly the pools of before.
"""

from __future__ import annotations

from typing import Final, TypeAlias, final

import attrs

from batchstate.base.errors import MemoryKindError

__all__ = [
    "FULL_ATTENTION",
    "MAX_STATE_ELEMENTS",
    "MemoryKind",
    "MemoryKinds",
    "RecurrentState",
    "SlidingWindow",
    "check_kinds",
    "reads_cached_prefixes",
]

# State buffers are indexed with int32 element offsets by the common Mamba and
# linear-attention kernels: every state slot, padding slot 0 included, must fit.
MAX_STATE_ELEMENTS: Final = 2**31 - 1


@final
@attrs.frozen
class SlidingWindow:
    """Sliding-window attention layers: each token reads the last `window` positions.

    Position `p` reads positions `[p - window + 1, p]`. Their KV lives in
    `num_tokens` window token slots (whole pages of the pools' page size,
    plus a padding page 0), apart from the full-attention pages.
    """

    window: int
    num_tokens: int


@final
@attrs.frozen
class RecurrentState:
    """State-space (Mamba-style) or linear-attention layers: one state per request.

    `state_size` elements per state (all such layers together), in
    `num_states` state slots (plus a padding slot 0).
    """

    state_size: int
    num_states: int


MemoryKind: TypeAlias = SlidingWindow | RecurrentState


@final
@attrs.frozen(repr=False)
class MemoryKinds:
    """The memory kinds a model keeps beside full-attention pages, at most one of each.

    >>> MemoryKinds((SlidingWindow(window=128, num_tokens=4096),)).is_hybrid
    True
    >>> FULL_ATTENTION.is_hybrid
    False
    """

    kinds: tuple[MemoryKind, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer keeps something other than full-attention KV."""
        return bool(self.kinds)

    @property
    def windows(self) -> tuple[SlidingWindow, ...]:
        return tuple(kind for kind in self.kinds if isinstance(kind, SlidingWindow))

    @property
    def states(self) -> tuple[RecurrentState, ...]:
        return tuple(kind for kind in self.kinds if isinstance(kind, RecurrentState))

    def __repr__(self) -> str:
        return f"MemoryKinds({self.kinds!r})" if self.kinds else "FULL_ATTENTION"


FULL_ATTENTION: Final = MemoryKinds()


def check_kinds(memory: object, max_context_len: int, page_size: int) -> None:
    """Raise `MemoryKindError` unless `memory` describes memory these pools can hold.

    A window must be in `[1, max_context_len]` and its token slots whole
    pages, enough for one row's window; a state must have a positive size
    and count, and every slot must fit `MAX_STATE_ELEMENTS`. Hybrid pools
    may have the prefix cache on (see `reads_cached_prefixes`).
    """
    if not isinstance(memory, MemoryKinds):
        raise MemoryKindError(f"memory must be a MemoryKinds, got {type(memory).__name__}")
    for kind in memory.kinds:
        if not isinstance(kind, SlidingWindow | RecurrentState):
            raise MemoryKindError(f"not a memory kind: {type(kind).__name__}")
    if len(memory.windows) > 1 or len(memory.states) > 1:
        raise MemoryKindError("at most one SlidingWindow and one RecurrentState")
    for window in memory.windows:
        if not 1 <= window.window <= max_context_len:
            raise MemoryKindError(
                f"a window of {window.window} tokens: it must be in [1, {max_context_len}],"
                " the context the pools hold"
            )
        one_row = (-(-window.window // page_size) + 1) * page_size  # a window straddles a page
        if window.num_tokens % page_size or window.num_tokens < one_row:
            raise MemoryKindError(
                f"{window.num_tokens} window token slots: they must be whole pages of"
                f" {page_size}, at least {one_row} (one row's window)"
            )
    for state in memory.states:
        if state.state_size < 1 or state.num_states < 1:
            raise MemoryKindError(
                f"a state of {state.state_size} elements in {state.num_states} slots:"
                " both must be >= 1"
            )
        elements = state.state_size * (state.num_states + 1)
        if elements > MAX_STATE_ELEMENTS:
            raise MemoryKindError(
                f"{state.num_states} states of {state.state_size} elements (and padding slot 0)"
                f" are {elements} elements, past the {MAX_STATE_ELEMENTS} an int32-indexed"
                " state buffer holds"
            )


def reads_cached_prefixes(memory: MemoryKinds) -> bool:
    """Whether a match on the prefix cache alone may be read instead of computed.

    The prefix cache's tree holds full-attention pages. A request that
    reads a cached prefix of `n` tokens on hybrid pools also needs the
    window pages of positions `[n - window + 1, n)` and the state after
    token `n - 1`, which the pools keep beside the tree at anchors
    (`HybridPools.cached`): there, only a match cut back to an anchor is read.
    """
    return not memory.is_hybrid
