"""A transition given a record of the wrong phase names itself in its `PhaseError`."""

from __future__ import annotations

import pytest

from batchstate import Filtered, Idle, PhaseError, filter_batch, finish_mixed, split
from tests.builders import make_phase, make_test_pools


def test_split_of_an_idle_batch_names_split() -> None:
    """`split` and `filter_batch` share their checks; each names the one the caller called."""
    batch, _ = make_phase(Idle, make_test_pools())
    with pytest.raises(PhaseError, match=r"^split takes Extended, Decoding or Filtered, got Idle$"):
        split(batch, [])  # type: ignore[arg-type]  # on purpose: an Idle batch
    with pytest.raises(
        PhaseError, match=r"^filter_batch takes Extended, Decoding or Filtered, got Idle$"
    ):
        filter_batch(batch, [])  # type: ignore[arg-type]  # on purpose: an Idle batch


def test_settle_of_a_batch_that_is_not_mixed_names_settle() -> None:
    batch, _ = make_phase(Filtered, make_test_pools())
    with pytest.raises(PhaseError, match=r"^finish_mixed takes Mixed, got Filtered$"):
        finish_mixed(batch)  # type: ignore[arg-type]  # on purpose: not a Mixed
