"""Sampling each row with its own parameters and its own seeded stream.

A row's token depends only on its logits, its `SamplingParams` and the
position of the token it samples, never on the batch it runs in:

- temperature 0 takes the argmax, exactly the greedy path;
- otherwise the logits are divided by the temperature, filtered (top-k,
  then top-p over what top-k kept, then min-p against the most likely
  token), and one token is drawn by inverse CDF from a uniform that the
  host derives from `(seed, position)` with a counter-based hash
  (`stream_uniforms`): no generator state is shared between rows or steps,
  so batching, retraction and re-prefill cannot shift a request's stream.

All the filtering runs on the device, row-wise, from the device sides of
the `Sampling` columns; the host only hashes seeds and positions, which it
holds, and uploads one uniform per row. Nothing is read back.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from batchstate import Sampling

__all__ = ["sample_logits", "stream_uniforms"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # SplitMix64's finaliser: a bijection of 64-bit words that mixes every bit.
    # numpy's uint64 array arithmetic wraps modulo 2**64, which is what it needs.
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def stream_uniforms(seeds: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """One uniform in [0, 1) per row, a pure function of the row's `(seed, position)`.

    >>> stream_uniforms([7, 7, 8], [3, 4, 3]).round(3).tolist()
    [0.421, 0.556, 0.191]
    >>> bool(stream_uniforms([7], [3])[0] == stream_uniforms([1, 7], [0, 3])[1])
    True
    """
    seed = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    position = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = _splitmix64(_splitmix64(seed) ^ position)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_logits(
    logits: torch.Tensor,
    sampling: Sampling,
    positions: npt.NDArray[np.int64],
) -> torch.Tensor:
    """Each row's next token under its own sampling parameters.

    Args:
        logits: `[num_rows, vocab_size]` on the device.
        sampling: the rows' columns; the device sides drive the math, the
            host seeds (with `positions`) the draws.
        positions: host int64 `[num_rows]`, the position of the token each
            row samples (its sequence length after this forward).

    Returns:
        device int64 `[num_rows]`.
    """
    if not sampling.temperature.host.any():
        return logits.argmax(dim=-1)  # all greedy: no upload, today's path
    device, dtype = logits.device, logits.dtype
    uniforms = torch.from_numpy(stream_uniforms(sampling.seed.host, positions)).to(device, dtype)
    temperature = sampling.temperature.device.to(dtype)
    sampled = temperature > 0
    scaled = logits / torch.where(sampled, temperature, 1.0)[:, None]
    # Most likely first; a stable sort keeps the order of (vanishingly rare) exact ties fixed.
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(dim=-1)
    rank = torch.arange(logits.shape[-1], device=device)
    top_k = sampling.top_k.device.to(torch.int64)[:, None]
    keep = (top_k <= 0) | (rank[None, :] < top_k)
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    # top-p: keep a token while the mass before it is below top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    keep &= before < sampling.top_p.device.to(dtype)[:, None]
    keep &= probs >= sampling.min_p.device.to(dtype)[:, None] * probs[:, :1]
    kept = torch.where(keep, probs, 0.0)
    cdf = kept.cumsum(dim=-1)
    target = uniforms * cdf[:, -1]
    # Every filter keeps a prefix of the sorted tokens: clamp into it against rounding.
    index = (cdf <= target[:, None]).sum(dim=-1)
    index = torch.minimum(index, keep.sum(dim=-1) - 1)
    drawn = order.gather(1, index[:, None]).squeeze(1)
    return torch.where(sampled, drawn, logits.argmax(dim=-1))
