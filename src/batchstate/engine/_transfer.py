"""A prefill server's memory written where `transfer_targets` names: KV, window tail, states.

The engine's stand-in for a disaggregated transfer (`ModelTokens.transfer`):
the prefill server (`prefill_alone`) hands over every prompt position's K/V
of each layer that keeps K/V and each state layer's state after the
prompt. Full-attention layers take every position, window layers only
their window's tail (the positions the pools hold window pages for), state
layers the state, each at the locations `transfer_targets` gives, gathered
and scattered on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchstate import Filtered, Pools, transfer_targets
from batchstate.engine._alone import Prefilled
from batchstate.engine._kv_cache import KVCache
from batchstate.engine._language_model import LanguageModel
from batchstate.forward.transfer import spans

__all__ = ["write_prefilled"]


def write_prefilled(
    model: LanguageModel,
    cache: KVCache,
    batch: Filtered[Any],
    pools: Pools,
    prefilled: Sequence[Prefilled],
) -> None:
    """Write each row's `prefilled[row]` where the pools hold its memory (mutates `cache`).

    Args:
        batch: an `admit_prefilled` batch, its memory allocated but not yet written.
        pools: the pools `admit_prefilled` returned.
        prefilled: per row, what its prefill server handed over for its prompt
            (`seq_lens[row]` positions), on the cache's device.
    """
    targets = transfer_targets(batch, pools)
    config = model.config
    kinds = [config.kind(layer) for layer in range(config.num_layers)]
    kept = [kind for kind in kinds if kind != "state"]  # the layers `Prefilled.k` holds
    full = [at for at, kind in enumerate(kept) if kind == "full"]
    k = torch.cat([row.k for row in prefilled], 1)  # [kv layers, seq_lens_sum, h, d]
    v = torch.cat([row.v for row in prefilled], 1)
    locs = targets.kv_locs.device
    cache.k[:, locs] = k[full]
    cache.v[:, locs] = v[full]
    for window in targets.hybrid.windows:
        # Each tail position's place among every row's positions, rows back to back (host).
        seq = batch.rows.seq_lens.host.astype(np.int64)
        rows, positions = spans(window.kv_starts.host.astype(np.int64), seq)
        taken = torch.from_numpy((np.cumsum(seq) - seq)[rows] + positions)
        taken = taken.to(k.device)  # a host copy
        layers = [at for at, kind in enumerate(kept) if kind == "window"]
        cache.window_k[:, window.out_cache_loc.device] = k[layers][:, taken]
        cache.window_v[:, window.out_cache_loc.device] = v[layers][:, taken]
    for state in targets.hybrid.states:
        states = torch.stack([row.states for row in prefilled], 1)  # [layers, rows, h, d, d]
        cache.states[:, state.state_indices.device] = states
