"""Nothing a user can write is shared with a record.

A read-only view of the caller's writable array, given as a host column,
used to be kept as it was: the caller's later writes changed the records,
and `check_batch` still passed. One cached `prefix_lens` array per row count
was shared by every fresh extend, so a write through `torch.as_tensor`
changed the positions of every later extend of that size.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import ColumnError, Columns, HostColumn, Req, extend, idle, make_pools

CPU: Final = torch.device("cpu")


@attrs.frozen(eq=False)
class _Tags(Columns):
    tag: HostColumn[np.int64]


def test_a_read_only_view_of_a_writable_array_is_refused_as_a_host_column() -> None:
    owner = np.array([7], dtype=np.int64)
    view = owner.view()
    view.setflags(write=False)
    pools = make_pools(4, 32, 64, CPU)
    with pytest.raises(ColumnError, match=r"tag: a read-only view of a writable array"):
        extend(idle(CPU, _Tags), [Req(0, (1, 2))], pools, _Tags(view))
    assert pools.is_newest and pools.num_free_slots == 4  # nothing was taken


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
    with pytest.warns(UserWarning, match="not writable"):
        torch.as_tensor(first.prefix_lens).fill_(5)  # what numpy's read-only flag cannot stop
    third, _ = extend(idle(CPU), [Req(2, (5, 6))], make_pools(4, 32, 64, CPU)).unwrap()
    assert second.prefix_lens.tolist() == [0] and third.prefix_lens.tolist() == [0]
