"""One request's sampling parameters: a plain value, importable without torch."""

from __future__ import annotations

from typing import final

import attrs

__all__ = ["GREEDY", "SamplingParams"]


@final
@attrs.frozen
class SamplingParams:
    """One request's sampling parameters, as an engine receives them.

    Args:
        temperature: 0 samples greedily (the most likely token).
        top_p: keep the smallest set of tokens whose probability reaches it.
        top_k: keep the `top_k` most likely tokens; 0 keeps all.
        min_p: drop tokens less likely than `min_p` times the most likely.
        seed: the request's own random stream, so its tokens do not depend
            on what it is batched with.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


GREEDY = SamplingParams()
