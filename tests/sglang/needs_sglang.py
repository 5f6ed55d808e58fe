"""What the test modules that run SGLang's own code share: why they skip when SGLang is
absent, and their marks. (Not `pytest.importorskip("sglang")`: SGLang imports only once
batchstate.sglang has stubbed its GPU packages, so that would skip where SGLang is
installed.)"""

from __future__ import annotations

import importlib.util
from typing import Final

import pytest

SGLANG_PRESENT: Final = importlib.util.find_spec("sglang") is not None
SGLANG_MISSING: Final = "SGLang 0.5.23 is not installed: docs/sglang.md#install gives the commands"

# SGLang warns at import and at run time about CUDA-only features on CPU; its tests share
# one xdist worker, which imports SGLang once.
SGLANG_MARKS: Final = [
    pytest.mark.filterwarnings(
        "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
    ),
    pytest.mark.xdist_group("sglang"),
]
