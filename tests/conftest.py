"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants

# Hypothesis draws values from the literal constants of every local module loaded so
# far, so a derandomized run generated other data depending on which test files its
# xdist worker had imported before (importing the engine's report module took all 24
# "kept private" cases out of the prefix-cache machine, which then failed its
# coverage check). An empty pool makes each run the same whatever ran before it.
# Private: Hypothesis has no setting for it.
providers._get_local_constants = Constants  # the empty pool, one per call


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test on one torch thread: tiny tensors on 2 shared cores, where extra
    intra-op threads only contend (a model test ran 30x slower beside another process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
