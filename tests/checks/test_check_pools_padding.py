"""check_pools refuses pools whose padding slot 0 owns tokens, and says so."""

from __future__ import annotations

import attrs
import pytest
import torch

from batchstate import InvariantViolation, check_pools, make_pools
from batchstate.base.mirrored import frozen

CPU = torch.device("cpu")


def test_padding_slot_owning_tokens_is_a_violation() -> None:
    pools = make_pools(4, 32, 64, CPU)
    check_pools(pools)
    slot_tokens = pools.slot_tokens.copy()
    slot_tokens[0] = 3
    broken = attrs.evolve(pools, slot_tokens=frozen(slot_tokens))
    with pytest.raises(InvariantViolation, match=r"^padding slot 0 owns tokens$"):
        check_pools(broken)
