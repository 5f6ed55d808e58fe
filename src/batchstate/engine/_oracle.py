"""The oracle: each request generated alone, with a plain contiguous KV cache.

No pools, no table, no batch: position `p` of the request is row `p` of its
own cache. A request's tokens depend only on its own tokens and its own
sampling parameters (greedy, or a draw from its seeded stream at each
position), so the engine's tokens for a request must equal these, however
it was batched, paged, retracted and re-prefilled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import final

import attrs

from batchstate import GREEDY, SamplingParams
from batchstate.engine._alone import AloneRun
from batchstate.engine._model import TinyModel

__all__ = ["OracleResult", "check_oracle", "generate_alone"]


def generate_alone(
    model: TinyModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    end_token: int,
    sampling: SamplingParams = GREEDY,
) -> tuple[int, ...]:
    """The tokens of one request run alone: up to `max_new_tokens`, stopping after `end_token`.

    Each token is sampled with `sampling` (greedy by default) through
    `TinyModel.sample`, a one-row batch drawing from the request's own
    `(seed, position)` stream: the engine's rows sample the same way. The
    forwards run on `AloneRun`, as the prefill server's do.

    >>> from batchstate.engine._model import ModelConfig, make_model
    >>> model = make_model(ModelConfig())
    >>> len(generate_alone(model, (5, 6, 7), 4, end_token=-1))
    4
    """
    run = AloneRun(model, sampling)
    generated: list[int] = []
    tokens: Sequence[int] = prompt
    while len(generated) < max_new_tokens:
        token = run.next_token(tokens)
        generated.append(token)
        if token == end_token:
            break
        tokens = (token,)
    return tuple(generated)


@final
@attrs.frozen
class OracleResult:
    """How many requests matched the oracle, and the first that did not."""

    num_checked: int
    num_mismatched: int
    first_mismatch: str  # empty when every request matched

    @property
    def passed(self) -> bool:
        return self.num_mismatched == 0

    def __str__(self) -> str:
        if self.passed:
            return f"pass ({self.num_checked}/{self.num_checked} requests match)"
        return (
            f"FAIL ({self.num_mismatched}/{self.num_checked} requests differ;"
            f" first: {self.first_mismatch})"
        )


def check_oracle(
    model: TinyModel,
    requests: Mapping[int, tuple[tuple[int, ...], int]],
    outputs: Mapping[int, Sequence[int]],
    end_token: int,
    on_request: Callable[[int], None] | None = None,
    *,
    sampling: Mapping[int, SamplingParams] | None = None,
) -> OracleResult:
    """Compare each request's engine tokens with `generate_alone`.

    Args:
        requests: rid -> (prompt, max_new_tokens).
        sampling: rid -> the request's sampling parameters; a missing rid
            (or None) samples greedily.
        outputs: rid -> the tokens the engine generated; a missing rid is a mismatch.
        on_request: called with the number of requests checked so far, after each.
    """
    mismatched: list[str] = []
    for checked, (rid, (prompt, max_new_tokens)) in enumerate(requests.items(), 1):
        params = GREEDY if sampling is None else sampling.get(rid, GREEDY)
        expected = generate_alone(model, prompt, max_new_tokens, end_token, params)
        got = tuple(outputs.get(rid, ()))
        if got != expected:
            mismatched.append(f"request {rid}: engine {list(got)} != alone {list(expected)}")
        if on_request is not None:
            on_request(checked)
    return OracleResult(len(requests), len(mismatched), mismatched[0] if mismatched else "")
