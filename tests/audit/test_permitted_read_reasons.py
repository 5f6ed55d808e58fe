"""The two reads the decode path makes on purpose carry their reasons into an audit.

On `meta` a read has no data: it is recorded, then torch refuses it. Only the op,
the device and the reason are checked here (not where the read was made).
"""

from __future__ import annotations

from typing import Final

import pytest
import torch

from batchstate import Sampled, decode, read_sampled, sync, verify
from batchstate.audit import device_reads
from tests.builders import make_extended, make_test_pools

META: Final = torch.device("meta")


def test_sync_reads_the_accepted_counts_once_with_its_reason() -> None:
    extended, pools = make_extended(make_test_pools(device=META), (3, 16, 9), device=META)
    decoding, pools = decode(extended, pools).unwrap()
    window, reserved = verify(decoding, [2, 0, 5], pools).unwrap()
    with device_reads() as log, pytest.raises(NotImplementedError, match="meta"):
        sync(window, torch.zeros(3, dtype=torch.int64, device=META), reserved)
    (read,) = log.report().reads
    assert (read.op, read.device) == ("aten._to_copy.default", "meta")
    assert read.permitted == "speculative sync: accepted draft counts"


def test_read_sampled_reads_the_tokens_once_with_its_reason() -> None:
    extended, _ = make_extended(make_test_pools(device=META), (3, 4), device=META)
    sampled = Sampled.of(extended.rows, torch.zeros(2, dtype=torch.int64, device=META))
    with device_reads() as log, pytest.raises(NotImplementedError, match="meta"):
        read_sampled(sampled)
    (read,) = log.report().reads
    assert (read.op, read.device) == ("aten._to_copy.default", "meta")
    assert read.permitted == "sampled tokens: finish checks"
