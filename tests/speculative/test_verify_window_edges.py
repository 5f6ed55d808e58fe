"""The verify window at its edges: columns that do not fit it, and a window of no rows."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from batchstate import RecordShapeError, check_batch, decode, filter_batch, sync, verify
from tests.builders import make_extended, make_probe, make_test_pools


def test_columns_of_another_length_are_refused_naming_the_window() -> None:
    extended, pools = make_extended(make_test_pools(), [3, 4])
    decoding, pools = decode(extended, pools).unwrap()
    window, _ = verify(decoding, [1, 1], pools).unwrap()
    message = (
        "Verifying.Probe.weight.host: expected a read-only float32 array [2],"
        " got a read-only float32 array [1]"
    )
    with pytest.raises(RecordShapeError, match=f"^{re.escape(message)}$"):
        attrs.evolve(window, columns=make_probe([0]))  # type: ignore[arg-type]  # on purpose


def test_a_window_of_no_rows_syncs_to_an_empty_batch() -> None:
    extended, pools = make_extended(make_test_pools(), [3, 4])
    decoding, pools = decode(filter_batch(extended, []), pools).unwrap()
    window, reserved = verify(decoding, [], pools).unwrap()
    synced, after = sync(window, torch.zeros(0, dtype=torch.int64), reserved)
    assert len(synced.rows) == 0
    assert synced.rows.max_seq_len == 0 and synced.rows.seq_lens_sum == 0
    check_batch(synced, compare_device=True)
    assert after.num_free_tokens == pools.num_free_tokens
