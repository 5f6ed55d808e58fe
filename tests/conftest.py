"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test on one torch thread: tiny tensors on 2 shared cores, where extra
    intra-op threads only contend (a model test ran 30x slower beside another process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
