"""The oracle: each request generated alone, with a plain contiguous KV cache.

No pools, no table, no batch: position `p` of the request is row `p` of its
own cache. A request's tokens depend only on its own tokens and its own
sampling parameters (greedy, or a draw from its seeded stream at each
position), so the engine's tokens for a request must equal these, however
it was batched, paged, retracted and re-prefilled.

For a transformers architecture the oracle is transformers' own
`generate`, on a copy of the weights with transformers' default attention
and cache. That runs in float32 with other summation orders than the
engine's kernels, so two logits within rounding of each other may swap
places: a greedy request whose tokens first differ where `generate`'s top
logit beats the engine's token by at most `NEAR_TIE` counts as matching up
to a near-tie (reported apart); any other difference is a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, final

import attrs
import torch

from batchstate import GREEDY, SamplingParams
from batchstate.engine._alone import AloneRun
from batchstate.engine._hf_model import HfModel
from batchstate.engine._language_model import LanguageModel

__all__ = ["NEAR_TIE", "OracleResult", "check_oracle", "generate_alone", "near_tie"]

NEAR_TIE: Final = 1e-4
"""The largest logit gap a float32 transformers model's greedy choice may lose to rounding.

Measured: the engine's logits and `generate`'s, for the same request and
position, differ by under 1e-5 on the `--model llama` and `qwen3` sizes
(tests/engine/test_hf_model.py); 1e-4 leaves ten times that.
"""


def generate_alone(
    model: LanguageModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    end_token: int,
    sampling: SamplingParams = GREEDY,
) -> tuple[int, ...]:
    """The tokens of one request run alone: up to `max_new_tokens`, stopping after `end_token`.

    Each token is sampled with `sampling` (greedy by default) through
    the model's `sample`, a one-row batch drawing from the request's own
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
    # Requests that matched up to a near-tie (see NEAR_TIE), not counted as mismatched.
    num_near_ties: int = 0

    @property
    def passed(self) -> bool:
        return self.num_mismatched == 0

    def __str__(self) -> str:
        if self.passed:
            ties = f", {self.num_near_ties} up to a near-tie" if self.num_near_ties else ""
            return f"pass ({self.num_checked}/{self.num_checked} requests match{ties})"
        return (
            f"FAIL ({self.num_mismatched}/{self.num_checked} requests differ;"
            f" first: {self.first_mismatch})"
        )


def check_oracle(
    model: LanguageModel,
    requests: Mapping[int, tuple[tuple[int, ...], int]],
    outputs: Mapping[int, Sequence[int]],
    end_token: int,
    on_request: Callable[[int], None] | None = None,
    *,
    sampling: Mapping[int, SamplingParams] | None = None,
) -> OracleResult:
    """Compare each request's engine tokens with `generate_alone` (a transformers model's:
    with `generate`, near-ties allowed as the module's notes say).

    Args:
        requests: rid -> (prompt, max_new_tokens).
        sampling: rid -> the request's sampling parameters; a missing rid
            (or None) samples greedily.
        outputs: rid -> the tokens the engine generated; a missing rid is a mismatch.
        on_request: called with the number of requests checked so far, after each.
    """
    mismatched: list[str] = []
    near_ties = 0
    for checked, (rid, (prompt, max_new_tokens)) in enumerate(requests.items(), 1):
        params = GREEDY if sampling is None else sampling.get(rid, GREEDY)
        got = tuple(outputs.get(rid, ()))
        if isinstance(model, HfModel):
            expected, logits = model.generate(prompt, max_new_tokens, end_token, params)
            if got != expected and params.temperature == 0 and near_tie(got, expected, logits):
                near_ties += 1
                expected = got
            name = "transformers.generate"
        else:
            expected = generate_alone(model, prompt, max_new_tokens, end_token, params)
            name = "alone"
        if got != expected:
            mismatched.append(f"request {rid}: engine {list(got)} != {name} {list(expected)}")
        if on_request is not None:
            on_request(checked)
    first = mismatched[0] if mismatched else ""
    return OracleResult(len(requests), len(mismatched), first, near_ties)


def near_tie(got: Sequence[int], expected: Sequence[int], logits: Sequence[torch.Tensor]) -> bool:
    """Whether `got` first leaves greedy `expected` where the two tokens' logits are within
    `NEAR_TIE`: `logits[i]` is the oracle's `[vocab]` before its token `i`.

    >>> logits = [torch.tensor([0.0, 1.0, 1.0 - 1e-6]), torch.tensor([2.0, 0.0, 0.0])]
    >>> near_tie((2, 5), (1, 0), logits), near_tie((0, 5), (1, 0), logits)
    (True, False)
    """
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if first is None:  # one is the other's prefix: a length differs, which no tie explains
        return False
    row = logits[first]
    return float(row[expected[first]] - row[got[first]]) <= NEAR_TIE
