"""A column set's columns of one dtype live in one array, and each is still read by name.

`Sampling` has three float32 columns, one int32 and one int64: three packs.
Taking, joining and uploading a set handles one array per pack; each column
is a read-only view of its row, made when first read. A set built by hand
(no packs) goes through the same functions and comes out packed, itself
unchanged; a class with a validator is built with every column at once.
"""

from __future__ import annotations

import copy
from typing import Final

import attrs
import numpy as np
import pytest
import torch
from benchmarks.counting import count_device_work

from batchstate import (
    ColumnError,
    Columns,
    HostColumn,
    Mirrored,
    Sampling,
    SamplingParams,
    build_columns,
)
from batchstate.base.mirrored import upload
from batchstate.columns.arguments import check_column_set, owned_host_columns
from batchstate.columns.columns import packed_of
from batchstate.columns.rows import Pending, join_pending, slice_columns, take_pending
from tests.builders import assert_probe, make_probe

CPU: Final = torch.device("cpu")
META: Final = torch.device("meta")
PARAMS: Final = [
    SamplingParams(0.5, top_p=0.9, top_k=40, min_p=0.05, seed=11),
    SamplingParams(0.7, top_p=0.8, top_k=0, min_p=0.0, seed=12),
    SamplingParams(0.0, top_p=1.0, top_k=5, min_p=0.1, seed=13),
]


def _finish(pending: Sampling | Pending, device: torch.device = CPU) -> Sampling:
    assert isinstance(pending, Pending)
    finished = pending.finish(upload(pending.hosts, device))
    assert isinstance(finished, Sampling)
    return finished


def _expect_sampling(columns: Sampling, params: list[SamplingParams]) -> None:
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        pair = getattr(columns, name)
        expected = np.array([getattr(p, name) for p in params], dtype=pair.host.dtype)
        assert pair.host.tolist() == expected.tolist(), name
        assert pair.device.tolist() == expected.tolist(), name
        assert not pair.host.flags.writeable
        assert pair.host.flags.c_contiguous and pair.device.is_contiguous()
        assert not np.shares_memory(pair.host, pair.device.numpy())


def test_columns_of_one_dtype_are_rows_of_one_array_on_both_sides() -> None:
    sampling = Sampling.of(PARAMS, CPU)
    _expect_sampling(sampling, PARAMS)
    floats = (sampling.temperature, sampling.top_p, sampling.min_p)
    assert len({id(pair.host.base) for pair in floats}) == 1
    assert len({pair.device.untyped_storage().data_ptr() for pair in floats}) == 1
    assert sampling.top_k.host.base is not sampling.temperature.host.base
    assert sampling.temperature is sampling.temperature  # made once, then kept


def test_take_and_join_upload_one_array_per_dtype() -> None:
    sampling = Sampling.of(PARAMS, CPU)
    taken = take_pending(sampling, np.array([2, 0]))
    joined = join_pending([sampling, Sampling.of(PARAMS[:1], CPU)])
    hosts = [
        len(pending.hosts) if isinstance(pending, Pending) else 0 for pending in (taken, joined)
    ]
    assert hosts == [3, 3]  # float32, int32, int64
    _expect_sampling(_finish(taken), [PARAMS[2], PARAMS[0]])
    _expect_sampling(_finish(joined), [*PARAMS, PARAMS[0]])


def test_a_slice_reads_its_own_rows_of_every_pack() -> None:
    sampling = Sampling.of(PARAMS, CPU)
    middle = slice_columns(slice_columns(sampling, 1, 3), 1, 2)
    _expect_sampling(middle, PARAMS[2:])
    assert slice_columns(sampling, 0, 3) is sampling
    assert_probe(slice_columns(make_probe([4, 5, 6]), 1, 3), [5, 6])


def test_a_set_built_by_hand_is_read_as_given_and_comes_out_packed() -> None:
    built = Sampling.of(PARAMS, CPU)
    by_hand = Sampling(
        *(
            Mirrored.from_host(np.array(getattr(built, name).host), CPU)
            for name in ("temperature", "top_p", "top_k", "min_p", "seed")
        )
    )
    assert packed_of(by_hand) is None
    before = [pair.host.copy() for pair in attrs.astuple(by_hand, recurse=False)]
    taken = _finish(take_pending(by_hand, np.array([1, 2])))
    joined = _finish(join_pending([by_hand, built]))
    sliced = slice_columns(by_hand, 0, 2)
    assert packed_of(taken) is not None and packed_of(joined) is not None
    _expect_sampling(taken, PARAMS[1:])
    _expect_sampling(joined, PARAMS + PARAMS)
    _expect_sampling(sliced, PARAMS[:2])
    after = [pair.host for pair in attrs.astuple(by_hand, recurse=False)]
    assert all(np.array_equal(old, new) for old, new in zip(before, after, strict=True))


def test_a_class_with_a_validator_is_built_with_every_column() -> None:
    seen: list[list[int]] = []

    def _record(_: object, __: object, value: HostColumn[np.int64]) -> None:
        seen.append(value.tolist())

    @attrs.frozen(eq=False)
    class Budgets(Columns):
        budget: HostColumn[np.int64] = attrs.field(validator=_record)

    budgets = build_columns(Budgets, {"budget": [3, 4, 5]}, CPU)
    taken = take_pending(budgets, np.array([2]))
    assert isinstance(taken, Pending)
    assert taken.finish(upload(taken.hosts, CPU)).budget.tolist() == [5]  # type: ignore[attr-defined]
    assert seen == [[3, 4, 5], [5]]


def test_a_name_that_is_no_column_is_still_an_attribute_error() -> None:
    sampling = Sampling.of(PARAMS, CPU)
    assert not hasattr(sampling, "temprature")
    with pytest.raises(AttributeError, match="temprature"):
        _ = sampling.temprature  # type: ignore[attr-defined]  # the point


def test_a_copy_of_a_packed_set_holds_the_same_values() -> None:
    sampling = Sampling.of(PARAMS, CPU)
    _expect_sampling(copy.deepcopy(sampling), PARAMS)
    _expect_sampling(copy.copy(sampling), PARAMS)


def test_packs_move_with_no_kernel_and_one_copy_on_meta() -> None:
    sampling = Sampling.of(PARAMS, META)
    with count_device_work() as work:
        taken = _finish(take_pending(sampling, np.array([0, 2])), META)
        joined = _finish(join_pending([taken, sampling]), META)
        _ = slice_columns(joined, 1, 4).min_p.device
    assert (work.kernels, work.copies) == (0, 2)
    assert joined.top_k.device.shape == (5,)


def test_a_slice_of_a_packed_set_passes_its_checks_and_a_wrong_length_names_a_column() -> None:
    sliced = slice_columns(Sampling.of(PARAMS, CPU), 2, 3)
    check_column_set(sliced, 1, CPU, "chunk")
    assert owned_host_columns(sliced) is sliced  # its packs are read-only and owned
    with pytest.raises(ColumnError, match=r"chunk\.Sampling\.temperature\.host: .* \[2\]"):
        check_column_set(sliced, 2, CPU, "chunk")
    with pytest.raises(ColumnError, match=r"chunk\.Sampling\.temperature\.device: .* on meta"):
        check_column_set(sliced, 1, META, "chunk")
