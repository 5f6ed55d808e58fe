"""Every numpy array a public value exposes is read-only, in copies and pickles too.

The walk goes through every field of records, pools, the prefix cache,
held chunks, departed rows and verify windows (and the column set each
carries), then does the same for a `copy.deepcopy` and a pickle round trip
of each value, and runs a transition on the copies.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, cast

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    Columns,
    Extended,
    HostColumn,
    Mirrored,
    NoColumns,
    Pools,
    PrefixCache,
    Req,
    build_columns,
    check_batch,
    check_pools,
    decode,
    extend,
    finish_mixed,
    idle,
    make_pools,
    mix,
    split,
    verify,
)

CPU: Final = torch.device("cpu")


@attrs.frozen
class _Cols(Columns):
    weight: Mirrored[np.float32]
    tag: HostColumn[np.int64]


def _cols(count: int) -> _Cols:
    values: dict[str, Sequence[object]] = {"weight": [0.5] * count, "tag": list(range(count))}
    return build_columns(_Cols, values, CPU)


def _values() -> dict[str, object]:
    # One of each public value, from a run with the prefix cache on and a column set.
    pools = make_pools(4, 64, 128, CPU, page_size=4, prefix_cache=True)
    reqs = [Req(0, tuple(range(9))), Req(1, tuple(range(9)))]
    extended, pools = extend(idle(CPU, _Cols), reqs, pools, _cols(2)).unwrap()
    kept, left = split(extended, [0])
    decoding, pools = decode(kept, pools).unwrap()
    window, pools = verify(decoding, [2], pools).unwrap()
    mixed, _ = mix(
        idle(CPU, _Cols), [Req(5, tuple(range(30)))], 8, copy.deepcopy(pools), (), _cols(1)
    ).unwrap()
    (chunk,) = finish_mixed(mixed).held
    return {
        "Extended": extended,
        "Filtered": kept,
        "Departed": left,
        "Decoding": decoding,
        "Verifying": window,
        "Mixed": mixed,
        "Chunked": chunk,
        "Pools": pools,
        "PrefixCache": pools.cache,
    }


def _arrays(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, np.ndarray]]:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        yield path, value
    elif attrs.has(type(value)):
        for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(value))):
            yield from _arrays(getattr(value, field.name), f"{path}.{field.name}", seen)
    elif isinstance(value, tuple | list):
        for index, item in enumerate(value):
            yield from _arrays(item, f"{path}[{index}]", seen)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _arrays(item, f"{path}[{key!r}]", seen)


def _exposed(value: object, name: str) -> list[tuple[str, np.ndarray]]:
    arrays = list(_arrays(value, name, set()))
    if isinstance(value, Pools):  # what the properties hand out, too
        for prop in ("free_slots", "free_pages", "prefix_lens"):
            arrays.append((f"{name}.{prop}", getattr(value, prop)))
        arrays.append((f"{name}.ref_counts()", value.ref_counts()))
    if isinstance(value, PrefixCache):  # a tree of tuples: its matches hand out arrays
        arrays.append((f"{name}.match()", value.match(tuple(range(8)))[1]))
    return arrays


COPIES: Final[dict[str, Callable[[object], object]]] = {
    "as built": lambda value: value,
    "deepcopy": copy.deepcopy,
    "pickle": lambda value: pickle.loads(pickle.dumps(value)),  # our own bytes
}


@pytest.mark.parametrize("how", list(COPIES))
def test_every_exposed_array_is_read_only(how: str) -> None:
    for name, value in _values().items():
        arrays = _exposed(COPIES[how](value), name)
        assert arrays, f"{name}: no arrays found to check"
        writable = [path for path, array in arrays if array.flags.writeable]
        assert not writable, f"{how}: writable arrays {writable}"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_run_goes_on_as_its_own_lineage(how: str) -> None:
    """A copy of a batch and its pools together decodes; the original pools stay the newest."""
    pools = make_pools(2, 32, 32, CPU, page_size=4, prefix_cache=True)
    batch, pools = extend(idle(CPU), [Req(0, tuple(range(9)))], pools).unwrap()
    copied = cast("tuple[Extended[NoColumns], Pools]", COPIES[how]((batch, pools)))
    copied_batch, copied_pools = copied
    decoded, after = decode(copied_batch, copied_pools).unwrap()
    check_batch(decoded, compare_device=True)
    check_pools(after, [decoded], compare_device=True)
    assert pools.is_newest and not copied_pools.is_newest
    assert np.shares_memory(after.table.host, after.table._cells)  # still the table's view
    check_pools(pools, [batch], compare_device=True)  # the original is untouched
