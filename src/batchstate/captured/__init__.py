"""Captured (CUDA-graph) forwards: padding to a captured size, buffers filled in one copy."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.captured.graph_buffers import GraphBuffers, fill
    from batchstate.captured.hybrid_buffers import HybridBuffers, fill_hybrid
    from batchstate.captured.padding import (
        FILL_FIELDS,
        SGLANG_FILLS,
        VLLM_FILLS,
        Padded,
        PaddedOutput,
        bucket,
        pad,
        unpad,
        unpad_tokens,
    )

__all__ = [
    "FILL_FIELDS",
    "SGLANG_FILLS",
    "VLLM_FILLS",
    "GraphBuffers",
    "HybridBuffers",
    "Padded",
    "PaddedOutput",
    "bucket",
    "fill",
    "fill_hybrid",
    "pad",
    "unpad",
    "unpad_tokens",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
