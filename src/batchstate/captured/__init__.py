"""Captured (CUDA-graph) forwards: padding to a captured size, buffers filled in one copy."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.captured.graph_buffers import GraphBuffers, fill_buffers
    from batchstate.captured.graph_buffers import fill_buffers as fill
    from batchstate.captured.hybrid_buffers import HybridBuffers, fill_hybrid_buffers
    from batchstate.captured.hybrid_buffers import fill_hybrid_buffers as fill_hybrid
    from batchstate.captured.padding import (
        PAD_FIELDS,
        SGLANG_PAD_VALUES,
        VLLM_PAD_VALUES,
        Padded,
        PaddedOutput,
        captured_size,
        pad,
        unpad,
        unpad_tokens,
    )
    from batchstate.captured.padding import PAD_FIELDS as FILL_FIELDS
    from batchstate.captured.padding import SGLANG_PAD_VALUES as SGLANG_FILLS
    from batchstate.captured.padding import VLLM_PAD_VALUES as VLLM_FILLS
    from batchstate.captured.padding import captured_size as bucket

__all__ = [
    "PAD_FIELDS",
    "SGLANG_PAD_VALUES",
    "VLLM_PAD_VALUES",
    "GraphBuffers",
    "HybridBuffers",
    "Padded",
    "PaddedOutput",
    "captured_size",
    "fill_buffers",
    "fill_hybrid_buffers",
    "pad",
    "unpad",
    "unpad_tokens",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["FILL_FIELDS", "SGLANG_FILLS", "VLLM_FILLS", "bucket", "fill", "fill_hybrid"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "bucket": "batchstate.captured.captured_size",
    "fill": "batchstate.captured.fill_buffers",
    "FILL_FIELDS": "batchstate.captured.PAD_FIELDS",
    "fill_hybrid": "batchstate.captured.fill_hybrid_buffers",
    "SGLANG_FILLS": "batchstate.captured.SGLANG_PAD_VALUES",
    "VLLM_FILLS": "batchstate.captured.VLLM_PAD_VALUES",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
