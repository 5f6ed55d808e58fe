"""Sizes of the tiny model: a plain value, importable (and checked) without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, final

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["DtypeName", "ModelConfig"]

DtypeName = Literal["float64", "float32", "bfloat16", "float16"]
_ITEMSIZES: Final[dict[DtypeName, int]] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@final
@attrs.frozen
class ModelConfig:
    """Sizes of the tiny model; small enough that hundreds of requests run in seconds."""

    vocab_size: int = 96
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 64
    seed: int = 0
    # float64 makes greedy ties (and so batch-order-dependent argmax flips) vanishingly rare.
    # A torch dtype's name, so that a config is built and checked without importing torch.
    dtype: DtypeName = "float64"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as torch's dtype (loads torch)."""
        import torch  # noqa: PLC0415  (configs load no torch; a model has it loaded)

        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return _ITEMSIZES[self.dtype]
