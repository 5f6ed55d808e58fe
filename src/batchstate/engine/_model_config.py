"""Sizes of the tiny model: a plain value, importable (and checked) without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, final

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "ARCHITECTURES",
    "ATTENTION_KERNELS",
    "HF_INSTALL",
    "HYBRID_LAYERS",
    "Architecture",
    "AttentionKernel",
    "DtypeName",
    "LayerKind",
    "ModelConfig",
]

DtypeName = Literal["float64", "float32", "bfloat16", "float16"]
Architecture = Literal["tiny", "llama", "qwen3"]
"""Whose layers the model runs: the engine's own tiny transformer (`engine/_model.py`), or a
Hugging Face transformers architecture (`engine/_hf_model.py`, the `hf` extra): Llama, or
Qwen3 (Llama's layout with RMSNorm on each head's queries and keys)."""
ARCHITECTURES: Final[tuple[Architecture, ...]] = ("tiny", "llama", "qwen3")
HF_INSTALL: Final = "pip install 'batchstate[hf]'"
"""What installs transformers, which the architectures other than `tiny` run."""
LayerKind = Literal["full", "window", "state"]
"""What a layer keeps: full-attention KV, sliding-window KV, or a recurrent state."""
AttentionKernel = Literal["paged", "ragged"]
"""How a full-attention layer orders its KV write and its reads (docs/engine.md).

`paged`: write the step's K/V into the cache, then read every key through
the table. `ragged`: attend over the step's own keys and values and over
the paged prefix, merge the two, then write (SGLang's FlashInfer ragged
path, FlashAttention's varlen path): it reads the prefix before the write.
"""
ATTENTION_KERNELS: Final[tuple[AttentionKernel, ...]] = ("paged", "ragged")

# `--model hybrid`: one layer of each kind, as gpt-oss interleaves window and full
# attention and Qwen3-Next interleaves linear attention (a recurrent state) and full.
HYBRID_LAYERS: Final[tuple[LayerKind, ...]] = ("window", "state", "full")
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
    # Each layer's kind, one per layer; () makes every layer full attention.
    layer_kinds: tuple[LayerKind, ...] = ()
    window: int = 32  # positions a "window" layer reads, itself included
    # The full-attention layers' kernel: the order of their KV write and reads.
    attention: AttentionKernel = "paged"
    architecture: Architecture = "tiny"
    # Query heads per K/V head (grouped-query attention); the cache keeps K/V heads only.
    kv_groups: int = 1

    def kind(self, layer: int) -> LayerKind:
        """What layer `layer` keeps."""
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    def ordinal(self, layer: int) -> int:
        """Layer `layer`'s index among the layers of its kind (its row in their cache)."""
        kind = self.kind(layer)
        return sum(self.kind(before) == kind for before in range(layer))

    def count(self, kind: LayerKind) -> int:
        """How many layers are of `kind`."""
        return sum(self.kind(layer) == kind for layer in range(self.num_layers))

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer keeps something other than full-attention KV."""
        return self.count("full") != self.num_layers

    @property
    def state_size(self) -> int:
        """Elements of one request's recurrent state, over all its state layers."""
        return self.count("state") * self.num_heads * self.head_dim * self.head_dim

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer: what the cache keeps per token."""
        return self.num_heads // self.kv_groups

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
