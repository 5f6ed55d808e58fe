"""Checks of records built by hand, and verify's device check, each shown to refuse.

Every column check of `Verifying` and the `extend_num_tokens` check of
`Extended` gets a value that breaks exactly it (length, dtype or device)
and must raise, naming the column; `verify` refuses pools on another device
before it allocates anything.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    BatchConflict,
    Decoding,
    DeviceOnly,
    Mirrored,
    RecordShapeError,
    Verifying,
    decode,
    verify,
)
from batchstate.base.mirrored import HostArray, frozen, host_int64
from tests.builders import CPU, make_extended, make_test_pools
from tests.strategies import assert_unchanged, snapshot

META = torch.device("meta")


def _window() -> Verifying:
    extended, pools = make_extended(make_test_pools(4), [3, 9, 5])
    decoding, pools = decode(extended, pools).unwrap()
    return verify(decoding, [2, 0, 1], pools).unwrap().batch


def _broken(tensor: torch.Tensor, how: str) -> torch.Tensor:
    if how == "length":
        return torch.cat((tensor, tensor[:1]))
    if how == "dtype":
        return tensor.to(torch.int32)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=META)


def _broken_host(array: HostArray, how: str) -> object:
    if how == "length":
        return frozen(np.concatenate((array, array[:1])))
    if how == "dtype":
        return frozen(array.astype(np.int32))
    return torch.from_numpy(array.copy())  # not a host array at all


def _pair(host: object, device: torch.Tensor) -> Mirrored:
    return Mirrored.trusted(host, device)  # type: ignore[arg-type]  # a mismatched pair, on purpose


@pytest.mark.parametrize("how", ["length", "dtype", "device"])
@pytest.mark.parametrize(
    "column",
    ["rids", "req_pool_indices.host", "req_pool_indices.device", "draft_lens", "seq_lens",
     "out_cache_loc.host", "out_cache_loc.device"],
)  # fmt: skip
def test_verifying_refuses_each_broken_column(column: str, how: str) -> None:
    """A wrong length, dtype or device on any column is a RecordShapeError naming it."""
    window = _window()
    slots, locs = window.req_pool_indices, window.out_cache_loc
    changes: dict[str, object]
    changes = {
        "rids": {"rids": _broken_host(window.rids, how)},
        "req_pool_indices.host": {
            "req_pool_indices": _pair(_broken_host(slots.host, how), slots.device)
        },
        "req_pool_indices.device": {
            "req_pool_indices": _pair(slots.host, _broken(slots.device, how))
        },
        "draft_lens": {"draft_lens": _broken_host(window.draft_lens, how)},
        "seq_lens": {"seq_lens": DeviceOnly(_broken(window.seq_lens.device, how))},
        "out_cache_loc.host": {"out_cache_loc": _pair(_broken_host(locs.host, how), locs.device)},
        "out_cache_loc.device": {"out_cache_loc": _pair(locs.host, _broken(locs.device, how))},
    }[column]  # type: ignore[assignment]  # each entry is a dict of fields
    with pytest.raises(RecordShapeError, match=rf"Verifying\.{column}: expected .*int64"):
        attrs.evolve(window, **changes)  # type: ignore[arg-type]  # wrong fields on purpose
    attrs.evolve(window)  # the unbroken window passes


def test_verifying_refuses_a_window_on_another_device_than_its_columns() -> None:
    """A window claiming the meta device with CPU columns is refused."""
    with pytest.raises(RecordShapeError, match=r"Verifying\.req_pool_indices\.device"):
        attrs.evolve(_window(), device=META)


def test_extended_refuses_extend_num_tokens_other_than_the_sum() -> None:
    """extend_num_tokens must equal sum(extend_lens), either way off."""
    extended, _ = make_extended(make_test_pools(), [3, 5])
    assert extended.extend_num_tokens == 8
    for wrong in (7, 9, 0):
        with pytest.raises(
            RecordShapeError, match=f"extend_lens sum to 8, extend_num_tokens is {wrong}"
        ):
            attrs.evolve(extended, extend_num_tokens=wrong)
    # Both moved together (columns as long as the new count) is consistent again.
    shorter = attrs.evolve(
        extended,
        input_ids=DeviceOnly(extended.input_ids.device[:7]),
        out_cache_loc=DeviceOnly(extended.out_cache_loc.device[:7]),
        extend_lens=host_int64([3, 4]),
        extend_num_tokens=7,
    )
    assert shorter.extend_num_tokens == 7


def test_verify_refuses_pools_on_another_device() -> None:
    """verify checks the table's device first: BatchConflict, nothing allocated."""
    extended, pools = make_extended(make_test_pools(4), [3, 9])
    decoding, pools = decode(extended, pools).unwrap()
    assert isinstance(decoding, Decoding)
    elsewhere = make_test_pools(4, device=META)
    state = snapshot(elsewhere)
    with pytest.raises(BatchConflict, match=f"the batch is on {CPU}, the pools' table on meta"):
        verify(decoding, [1, 1], elsewhere)
    assert_unchanged(state, elsewhere, "pools on another device")
