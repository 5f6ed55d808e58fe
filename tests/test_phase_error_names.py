"""A transition given a record of the wrong phase names itself in its `PhaseError`."""

from __future__ import annotations

import pytest

from batchstate import Idle, PhaseError, filter_batch, split
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
