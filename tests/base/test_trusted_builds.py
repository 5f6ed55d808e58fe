"""The unchecked builders set every field: `Mirrored._pair` and `build_rows`.

Both set slots through each slot's own setter instead of the attrs
`__init__`; a field added to `Rows` and left out of `build_rows`' setters
would be a record with an unset slot, which these tests refuse.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from batchstate import Req, Rows, check_batch, decode, extend, idle, make_pools, merge
from batchstate.base.mirrored import Mirrored, frozen
from batchstate.records.rows import _ROW_SETTERS

CPU = torch.device("cpu")


def test_build_rows_has_one_setter_per_field_in_field_order() -> None:
    names = [setter.__self__.__name__ for setter in _ROW_SETTERS]  # type: ignore[attr-defined]  # a slot setter is a method-wrapper
    assert names == [field.name for field in attrs.fields(Rows)]


def test_rows_built_by_transitions_have_every_field_set() -> None:
    pools = make_pools(4, 64, 64, CPU)
    first, pools = extend(idle(CPU), [Req(0, (1, 2, 3))], pools).unwrap()
    decoded, pools = decode(first, pools).unwrap()
    second, pools = extend(idle(CPU), [Req(1, (4, 5))], pools).unwrap()
    merged = merge(decoded, second)
    check_batch(merged, compare_device=True)
    for batch in (decoded, merged):
        for field in attrs.fields(Rows):
            getattr(batch.rows, field.name)  # an unset slot raises AttributeError
    assert merged.rows.seq_lens.host.tolist() == [4, 2]


def test_a_pair_holds_both_sides_and_stays_frozen() -> None:
    host = frozen(np.array([3, 5], dtype=np.int64))
    pair = Mirrored.trusted(host, torch.tensor([3, 5]))
    assert pair.host is host
    assert pair.device.tolist() == [3, 5]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        pair.host = host  # type: ignore[misc]  # the point: frozen
    with pytest.raises(ValueError, match="read-only"):
        pair.host[0] = 7
