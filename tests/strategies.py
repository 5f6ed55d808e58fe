"""Hypothesis strategies and value snapshots shared by the reliability tests.

Strategies live here, in one module, so that every property test draws pool
shapes, prompts and keep patterns the same way. `snapshot` and
`assert_unchanged` are the one definition of "an input is unchanged": every
tensor of a record or of pools, host and device (the request-to-token table
included), compared by value, dtype, shape and device.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Final, NamedTuple

import attrs
import numpy as np
import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st

from batchstate import FreeList, InvariantViolation

# The long profile: `BATCHSTATE_LONG=1 python -m pytest tests/properties/test_state_machine.py`.
LONG: Final = os.environ.get("BATCHSTATE_LONG", "") not in ("", "0")
# The mutation profile (tools/mutation.py sets it): small, derandomized budgets,
# so each mutant runs fast and the same mutant is killed (or not) every run.
# No shrinking: a mutant needs one failing example, not the smallest one, and
# shrinking a failure of a stateful test can outlast mutmut's time limit.
FAST: Final = os.environ.get("BATCHSTATE_FAST", "") not in ("", "0")
if FAST:
    settings.register_profile(
        "mutation",
        max_examples=20,
        derandomize=True,
        deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )
    settings.load_profile("mutation")


class PoolShape(NamedTuple):
    """Arguments of `make_pools`, small enough to fill up within a few steps."""

    max_reqs: int
    max_context_len: int
    num_kv_tokens: int
    page_size: int


@st.composite
def pool_shapes(draw: st.DrawFn) -> PoolShape:
    """Tight pools, page size 1 or 16: full slot and KV pools are reached often."""
    page_size = draw(st.sampled_from([1, 16]))
    max_reqs = draw(st.integers(1, 6))
    if page_size == 1:
        max_context_len = draw(st.integers(1, 24))
        num_pages = draw(st.integers(0, 64))
    else:
        # Not always a multiple of the page: a row's last page may be cut by the table's width.
        max_context_len = draw(st.integers(1, 56))
        num_pages = draw(st.integers(0, 8))
    return PoolShape(max_reqs, max_context_len, num_pages * page_size, page_size)


def prompt_lengths(max_context_len: int, cached: int = 0) -> st.SearchStrategy[int]:
    """Prompt lengths past `cached` tokens: mostly fitting, sometimes empty or one too long."""
    if cached >= max_context_len:
        return st.sampled_from([cached, cached + 1])
    fitting = st.integers(cached + 1, max_context_len)
    return st.one_of(
        fitting,
        fitting,
        fitting,
        st.sampled_from([cached, cached + 1, max_context_len, max_context_len + 1]),
    )


def keep_patterns() -> st.SearchStrategy[tuple[bool, ...]]:
    """A keep mask, tiled over the rows: none, all, staggered finishes, or random."""
    return st.one_of(
        st.sampled_from([(False,), (True,), (True, False), (False, True), (True, True, False)]),
        st.lists(st.booleans(), min_size=1, max_size=8).map(tuple),
    )


def tile(pattern: Sequence[bool], num_rows: int) -> list[int]:
    """The row positions that `pattern`, repeated over `num_rows` rows, keeps."""
    return [row for row in range(num_rows) if pattern[row % len(pattern)]]


# ---- snapshots ------------------------------------------------------------------------------


@attrs.frozen
class TensorState:
    """A tensor's value, dtype, shape and device, copied to the host."""

    value: tuple[object, ...]
    dtype: torch.dtype | np.dtype[np.generic]
    shape: tuple[int, ...]
    device: torch.device | None  # None: a numpy array on the host


def snapshot(value: object) -> object:
    """A deep, comparable copy of `value`: attrs records, tuples, arrays and tensors, walked."""
    if isinstance(value, np.ndarray):
        return TensorState(tuple(value.ravel().tolist()), value.dtype, value.shape, None)
    if isinstance(value, torch.Tensor):
        data = value if value.device.type == "meta" else value.detach().cpu()
        flat = () if value.device.type == "meta" else tuple(data.flatten().tolist())
        return TensorState(flat, value.dtype, tuple(value.shape), value.device)
    if isinstance(value, FreeList):
        # A free list's value is its ids: cells past its tail belong to no value
        # (a give from it writes there), so a snapshot ignores them.
        return (FreeList, snapshot(value.ids), len(value))
    kind = type(value)
    if attrs.has(kind):
        fields = attrs.fields(kind)
        return (kind, tuple(snapshot(getattr(value, field.name)) for field in fields))
    if isinstance(value, tuple | list):
        return (type(value), tuple(snapshot(item) for item in value))
    return value


def assert_unchanged(before: object, value: object, what: str = "input") -> None:
    """Fail, naming the first difference, unless `value` snapshots to `before`."""
    after = snapshot(value)
    assert after == before, f"{what} changed:\n{_first_difference(before, after)}"


def _first_difference(before: object, after: object, path: str = "") -> str:
    if (
        isinstance(before, TensorState)
        and isinstance(after, TensorState)
        and len(before.value) == len(after.value)
    ):
        pairs = zip(before.value, after.value, strict=True)
        changed = [(i, old, new) for i, (old, new) in enumerate(pairs) if old != new]
        cells = ", ".join(f"{i}: {old} -> {new}" for i, old, new in changed[:8])
        if changed:
            return f"at {path}, {len(changed)} elements of {before.shape} changed (flat {cells})"
    if isinstance(before, tuple) and isinstance(after, tuple) and len(before) == len(after):
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            if old != new:
                return _first_difference(old, new, f"{path}[{index}]")
    return f"at {path or 'top'}: {before!r} -> {after!r}"[:2000]


CPU: Final = torch.device("cpu")


def raises_exactly(message: str) -> pytest.RaisesExc[InvariantViolation]:
    """Expect an `InvariantViolation` whose whole message is `message`."""
    return pytest.raises(InvariantViolation, match=f"^{re.escape(message)}$")
