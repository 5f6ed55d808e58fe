"""Nothing a user can write is shared with a record.

A read-only view of the caller's writable array, given as a host column,
used to be kept as it was: the caller's later writes changed the records,
and `check_batch` still passed. An admission now keeps a copy. One cached
`prefix_lens` array per row count was shared by every fresh extend, so a
write through `torch.as_tensor` changed the positions of every later extend
of that size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    Batch,
    ColumnError,
    Columns,
    Extended,
    Filtered,
    HostColumn,
    InvariantViolation,
    RecordShapeError,
    Req,
    admit_prefilled,
    check_batch,
    check_pools,
    decode,
    extend,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
)
from batchstate.base.mirrored import frozen
from batchstate.columns.columns import C

CPU: Final = torch.device("cpu")


@attrs.frozen(eq=False)
class _Tags(Columns):
    tag: HostColumn[np.int64]


@pytest.mark.parametrize("admission", ["extend", "admit_prefilled", "mix"])
def test_a_read_only_view_of_a_writable_array_is_copied_not_kept(admission: str) -> None:
    """The caller writes the array it gave a view of; the records keep the values they got."""
    owner = np.array([7, 8], dtype=np.int64)
    view = owner.view()
    view.setflags(write=False)
    tags = _Tags(view)
    pools = make_pools(4, 32, 64, CPU)
    reqs = [Req(0, (1, 2)), Req(1, (3, 4, 5))]
    if admission == "mix":
        step, pools = mix(idle(CPU, _Tags), reqs, 64, pools, (), tags).unwrap()
        batch: Batch[_Tags] = finish_mixed(step).running
    elif admission == "extend":
        batch, pools = extend(idle(CPU, _Tags), reqs, pools, tags).unwrap()
    else:
        batch, pools = admit_prefilled(idle(CPU, _Tags), reqs, pools, tags).unwrap()
    assert tags.tag is view  # the caller's set is not changed either
    assert not np.shares_memory(batch.rows.columns.tag, owner)
    owner[:] = [70, 80]  # the caller's own array, still writable
    assert batch.rows.columns.tag.tolist() == [7, 8]
    check_batch(batch, compare_device=True)
    check_pools(pools, [batch], compare_device=True)


def test_a_record_built_by_hand_with_such_a_view_is_refused() -> None:
    """Only an admission copies: a record built by hand must own its arrays."""
    owner = np.array([7], dtype=np.int64)
    view = owner.view()
    view.setflags(write=False)
    batch, _ = extend(
        idle(CPU, _Tags), [Req(0, (1, 2))], make_pools(4, 32, 64, CPU), _Tags(frozen(owner.copy()))
    ).unwrap()
    with pytest.raises(RecordShapeError, match=r"tag: a read-only view of a writable array"):
        attrs.evolve(batch.rows, columns=_Tags(view))


def test_a_read_only_view_of_a_read_only_owner_is_accepted() -> None:
    owner = np.array([7], dtype=np.int64)
    owner.setflags(write=False)
    view = owner.view()
    pools = make_pools(4, 32, 64, CPU)
    batch, _ = extend(idle(CPU, _Tags), [Req(0, (1, 2))], pools, _Tags(view)).unwrap()
    assert batch.rows.columns.tag.tolist() == [7]


def test_fresh_extends_of_one_size_share_no_prefix_lens_array() -> None:
    first, _ = extend(idle(CPU), [Req(0, (1, 2))], make_pools(4, 32, 64, CPU)).unwrap()
    second, _ = extend(idle(CPU), [Req(1, (3, 4))], make_pools(4, 32, 64, CPU)).unwrap()
    assert not np.shares_memory(first.prefix_lens, second.prefix_lens)
    with warnings.catch_warnings():  # torch warns "not writable" once per process
        warnings.simplefilter("ignore", UserWarning)
        torch.as_tensor(first.prefix_lens).fill_(5)  # what numpy's read-only flag cannot stop
    third, _ = extend(idle(CPU), [Req(2, (5, 6))], make_pools(4, 32, 64, CPU)).unwrap()
    assert second.prefix_lens.tolist() == [0] and third.prefix_lens.tolist() == [0]


def _combine(a: Filtered[C], b: Extended[C]) -> Filtered[C]:
    return merge(a, b)


def test_sets_mixed_through_a_users_generic_helper_are_refused_at_run_time() -> None:
    """mypy passes `decode(_combine(f, e), pools)` as Decoding[Any]; `merge` refuses it."""
    pools = make_pools(4, 32, 64, CPU)
    tagged, pools = extend(
        idle(CPU, _Tags), [Req(0, (1, 2))], pools, _Tags(frozen(np.array([7])))
    ).unwrap()
    plain, pools = extend(idle(CPU), [Req(1, (3, 4))], pools).unwrap()
    running = merge(idle(CPU, _Tags), tagged)
    with pytest.raises(ColumnError, match="cannot merge NoColumns columns into _Tags ones"):
        decode(_combine(running, plain), pools)  # mypy passes this line: see the docstring
    check_pools(pools, [running])
    check_pools(pools, [plain])


@pytest.mark.parametrize("share", [torch.from_numpy, torch.as_tensor, torch.asarray])
def test_a_write_through_torch_is_caught_by_the_checks_the_docs_name(
    share: Callable[[np.ndarray], torch.Tensor],
) -> None:
    """numpy's read-only flag cannot stop these; `check_batch` (host only) catches a write
    that breaks a derived value, `compare_device=True` any write."""
    pools = make_pools(4, 32, 64, CPU)
    batch, pools = extend(idle(CPU), [Req(0, (1, 2)), Req(1, (3, 4, 5))], pools).unwrap()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it shares anyway
        lens = share(batch.rows.seq_lens.host)
    lens[0] += 1
    with pytest.raises(InvariantViolation, match="seq_lens_sum=5, seq_lens sum to 6"):
        check_batch(batch)
    lens[0], lens[1] = 3, 2  # the same sum and longest row: only the device shows it
    check_batch(batch)
    with pytest.raises(InvariantViolation, match="seq_lens: host mirror != device"):
        check_batch(batch, compare_device=True)
