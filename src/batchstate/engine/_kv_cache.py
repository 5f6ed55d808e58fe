"""The K/V a forward writes and reads, per kind of layer: sized by the pools, on the model's device.

Full-attention layers keep K/V at the pools' token locations; a hybrid
model's window layers keep theirs at window token locations, and its
state layers one state per state slot. Slot or location 0 of each is
padding, written by padded rows and never read by a real one.
"""

from __future__ import annotations

from typing import final

import attrs
import torch

from batchstate import Pools
from batchstate.engine._language_model import LanguageModel

__all__ = ["KVCache", "make_kv_cache"]


@final
@attrs.frozen(eq=False)
class KVCache:
    """K and V for every location the pools hand out, per kind of layer.

    NOTE: written in place by every forward, at `out_cache_loc` only;
    location 0 (the padding page) is read for padding keys and masked out.
    A full-attention model's window and state tensors hold no layer.
    """

    k: torch.Tensor  # [full layers, kv_cache_size, num_kv_heads, head_dim]
    v: torch.Tensor  # the same
    window_k: torch.Tensor  # [window layers, window token slots + padding page, kv heads, head_dim]
    window_v: torch.Tensor  # the same
    states: torch.Tensor  # [state layers, num_states + 1, heads, head_dim, head_dim]


def make_kv_cache(model: LanguageModel, pools: Pools) -> KVCache:
    """A zeroed cache for every layer kind of `model`, sized by `pools`, on the model's device.

    Raises:
        ValueError: a hybrid model on pools without its window pages or state slots.
    """
    config = model.config
    heads = (config.num_heads, config.head_dim)
    kv_heads = (config.num_kv_heads, config.head_dim)  # grouped-query: K/V heads only
    windows, states = pools.memory.windows, pools.memory.states
    if (bool(config.count("window")), bool(config.count("state"))) != (
        bool(windows),
        bool(states),
    ) or any(window.window != config.window for window in windows):
        raise ValueError(f"pools with {pools.memory!r} do not hold the layers of {config}")

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=config.torch_dtype, device=model.device)

    window_slots = (windows[0].num_pages + 1) * pools.page_size if windows else 0
    num_states = states[0].kind.num_states + 1 if states else 0
    return KVCache(
        zeros(config.count("full"), pools.kv_cache_size, *kv_heads),
        zeros(config.count("full"), pools.kv_cache_size, *kv_heads),
        zeros(config.count("window"), window_slots, *kv_heads),
        zeros(config.count("window"), window_slots, *kv_heads),
        zeros(config.count("state"), num_states, *heads, config.head_dim),
    )
