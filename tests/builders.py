"""Small builders shared by the tests: pools, requests, and a record of each phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs
import numpy as np
import torch
from typing_extensions import TypeVar

from batchstate import (
    Batch,
    BatchAndPools,
    Columns,
    Decoding,
    DeviceOnly,
    Extended,
    Filtered,
    HostColumn,
    Idle,
    Mirrored,
    NoColumns,
    Pools,
    Req,
    build_columns,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
)

CPU: Final = torch.device("cpu")
C = TypeVar("C", bound=Columns, default=NoColumns)
PHASES: Final = (Idle, Extended, Decoding, Filtered)


def make_test_pools(
    page_size: int = 1,
    *,
    max_reqs: int = 16,
    max_context_len: int = 64,
    num_kv_tokens: int = 512,
    device: torch.device = CPU,
    prefix_cache: bool = False,
) -> Pools:
    """Roomy pools for a few short requests (the prefix cache off unless asked)."""
    return make_pools(
        max_reqs, max_context_len, num_kv_tokens, device, page_size, prefix_cache=prefix_cache
    )


def make_reqs(lengths: Sequence[int], first_rid: int = 0) -> list[Req]:
    """One request per length, with distinct rids and recognisable token ids (>= 0, as
    every token id is: a negative rid's are its absolute value's)."""
    return [
        Req(rid, tuple(range(100 * abs(rid), 100 * abs(rid) + length)))
        for rid, length in ((first_rid + i, length) for i, length in enumerate(lengths))
    ]


@attrs.frozen(eq=False)
class Probe(Columns):
    """A column set with one column of each kind; values follow from each row's rid."""

    weight: Mirrored[np.float32]
    lora: DeviceOnly
    budget: HostColumn[np.int64]


def probe_values(rid: int) -> tuple[float, int, int]:
    """The row of `rid` in every `Probe` column."""
    return rid / 4, 100 + rid, 1000 + rid


def make_probe(rids: Sequence[int], device: torch.device = CPU) -> Probe:
    """`Probe` columns for rows `rids`, in one upload."""
    values = [probe_values(rid) for rid in rids]
    return build_columns(
        Probe,
        {
            "weight": [v[0] for v in values],
            "lora": np.array([v[1] for v in values], dtype=np.int64),
            "budget": [v[2] for v in values],
        },
        device,
    )


def assert_probe(columns: object, rids: Sequence[int]) -> None:
    """Every `Probe` column, every side, holds the values of `rids`, in row order."""
    assert isinstance(columns, Probe)
    values = [probe_values(rid) for rid in rids]
    weights = [v[0] for v in values]
    assert columns.weight.host.tolist() == weights
    assert columns.weight.device.tolist() == weights
    assert columns.weight.device.dtype == torch.float32
    assert not np.shares_memory(columns.weight.host, columns.weight.device.numpy())
    assert columns.lora.device.tolist() == [v[1] for v in values]
    assert columns.budget.tolist() == [v[2] for v in values]
    assert not columns.budget.flags.writeable


def make_extended(
    pools: Pools, lengths: Sequence[int] = (3, 5, 7), first_rid: int = 0, device: torch.device = CPU
) -> BatchAndPools[Extended]:
    """An extend of fresh requests; fails the test if it does not fit."""
    return extend(idle(device), make_reqs(lengths, first_rid), pools).unwrap()


def make_phase(
    phase: type[object],
    pools: Pools,
    lengths: Sequence[int] = (3, 5, 7),
    first_rid: int = 0,
    device: torch.device = CPU,
    *,
    probe: bool = False,
) -> tuple[Batch[Any], Pools]:
    """A record of `phase` reached through the public transitions (with `Probe` columns)."""
    if phase is Idle:
        return (idle(device, Probe) if probe else idle(device)), pools
    reqs = make_reqs(lengths, first_rid)
    if probe:
        columns = make_probe([req.rid for req in reqs], device)
        extended, pools = extend(idle(device, Probe), reqs, pools, columns).unwrap()
        return _advance(extended, pools, phase, len(lengths))
    plain, pools = extend(idle(device), reqs, pools).unwrap()
    return _advance(plain, pools, phase, len(lengths))


def _advance(
    extended: Extended[C], pools: Pools, phase: type[object], num_rows: int
) -> tuple[Batch[C], Pools]:
    # Extended, then a decode, then every other row filtered out: the phase asked for.
    if phase is Extended:
        return extended, pools
    decoding, pools = decode(extended, pools).unwrap()
    if phase is Decoding:
        return decoding, pools
    return filter_batch(decoding, list(range(0, num_rows, 2))), pools
