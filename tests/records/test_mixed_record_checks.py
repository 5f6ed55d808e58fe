"""A `Mixed` built or changed by hand is refused, naming the one field that does not fit.

`mix` and `decode_sampled` build the record row for row; these change one field of a
real one with `attrs.evolve`, which runs the same checks as the constructor.
"""

from __future__ import annotations

import re
from typing import Any, Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import Mixed, RecordShapeError, idle, mix
from batchstate.base.mirrored import DeviceOnly, host_int64
from tests.builders import make_reqs, make_test_pools
from tests.transitions.test_mixed import _chunked, _running

META: Final = torch.device("meta")


def _mixed() -> Mixed[Any]:
    """Two extend rows (the second stops part way), then two decode rows: 42 tokens."""
    running, pools = _running(make_test_pools())
    chunk, pools = _chunked(pools)
    mixed, _ = mix(running, [chunk, *make_reqs([30], 50)], 40, pools, [11, 12]).unwrap()
    assert mixed.num_extend_rows == 2 and mixed.partial == (1,) and mixed.num_tokens == 42
    return mixed


def _refused(message: str) -> pytest.RaisesExc[RecordShapeError]:
    return pytest.raises(RecordShapeError, match=f"^{re.escape(message)}$")


def test_every_row_an_extend_row_and_no_extend_row_are_both_accepted() -> None:
    """The ends of the extend-row range: all rows prompts, or all rows decode rows."""
    prompts, _ = mix(idle("cpu"), make_reqs([3, 4]), 40, make_test_pools()).unwrap()
    assert prompts.num_extend_rows == len(prompts.rows) == 2
    assert attrs.evolve(prompts).num_extend_rows == 2
    running, pools = _running(make_test_pools())
    decodes, _ = mix(running, [], 40, pools, [11, 12]).unwrap()
    assert decodes.num_extend_rows == 0 and len(decodes.rows) == 2
    assert attrs.evolve(decodes).num_tokens == 2


def test_the_first_extend_row_may_be_partial() -> None:
    mixed = _mixed()
    assert attrs.evolve(mixed, partial=(0,)).partial == (0,)


@pytest.mark.parametrize("field", ["prefix_lens", "extend_lens"])
def test_a_host_length_column_of_the_wrong_dtype(field: str) -> None:
    mixed = _mixed()
    wrong = getattr(mixed, field).astype(np.int32)
    wrong.flags.writeable = False
    with _refused(
        f"Mixed.{field}: expected a read-only int64 array [4], got a read-only int32 array [4]"
    ):
        attrs.evolve(mixed, **{field: wrong})


@pytest.mark.parametrize(
    ("num_extend_rows", "partial"), [(-1, (1,)), (5, (1,)), (2, (2,)), (2, (-1,)), (2, (0, 3))]
)
def test_extend_rows_and_partial_rows_that_do_not_fit(
    num_extend_rows: int, partial: tuple[int, ...]
) -> None:
    mixed = _mixed()
    with _refused(
        f"Mixed: {num_extend_rows} extend rows and partial rows {partial} do not fit 4 rows"
    ):
        attrs.evolve(mixed, num_extend_rows=num_extend_rows, partial=partial)


def test_lengths_that_do_not_add_up_to_seq_lens() -> None:
    mixed = _mixed()
    prefix = mixed.prefix_lens.copy()
    prefix[3] += 1
    with _refused("Mixed: seq_lens differ from prefix_lens + extend_lens"):
        attrs.evolve(mixed, prefix_lens=host_int64(prefix.tolist()))


def test_a_decode_row_computing_two_tokens() -> None:
    """The sums still match seq_lens; a decode row must compute exactly one token."""
    mixed = _mixed()
    prefix, extend = mixed.prefix_lens.copy(), mixed.extend_lens.copy()
    prefix[2] -= 1
    extend[2] += 1
    with _refused("Mixed: seq_lens differ from prefix_lens + extend_lens"):
        attrs.evolve(
            mixed, prefix_lens=host_int64(prefix.tolist()), extend_lens=host_int64(extend.tolist())
        )


def test_extend_tokens_other_than_the_extend_rows_lengths() -> None:
    mixed = _mixed()
    with _refused("Mixed: num_extend_tokens differs from the extend rows' lens"):
        attrs.evolve(mixed, num_extend_tokens=41)


@pytest.mark.parametrize("field", ["input_ids", "positions", "out_cache_loc"])
@pytest.mark.parametrize(
    ("tensor", "got"),
    [
        (torch.zeros(41, dtype=torch.int64), "torch.int64 [41] on cpu"),
        (torch.zeros(42, dtype=torch.int32), "torch.int32 [42] on cpu"),
        (torch.zeros(42, dtype=torch.int64, device=META), "torch.int64 [42] on meta"),
    ],
)
def test_a_token_column_of_the_wrong_length_dtype_or_device(
    field: str, tensor: torch.Tensor, got: str
) -> None:
    mixed = _mixed()
    with _refused(f"Mixed.{field}: expected int64 [42] on cpu, got {got}"):
        changes: dict[str, Any] = {field: DeviceOnly(tensor)}
        attrs.evolve(mixed, **changes)
