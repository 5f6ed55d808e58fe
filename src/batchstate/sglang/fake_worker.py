"""`FakeWorker`: what SGLang's scheduler calls in place of its `TpModelWorker`, on CPU.

Its forward reads the batch the way a model does (the input ids SGLang materialised
for it, from the prefill's host staging or, for a decode, from the overlap future
map's relay of the last sampled tokens) and returns SGLang's own
`GenerationBatchResult`. Each row's next token is a fixed function of the row's last
input id and its position, so a request whose relayed input or length is wrong
continues with other tokens than it would have.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Final

import torch

VOCAB: Final = 32000
"""The vocabulary the fake model samples from (SGLang's `vocab_size` in the driver)."""


def next_token(last_input_id: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The fake model's greedy choice for rows ending in `last_input_id` at `position`:
    a multiplicative hash of both, in [100, VOCAB)."""
    mixed = last_input_id.long() * 1_000_003 + position.long() * 7_919 + 12_345
    return torch.remainder(mixed, VOCAB - 100) + 100


class FakeWorker:
    """A stand-in for SGLang's `TpModelWorker`: `forward_batch_generation` only.

    `forwards` counts its forwards; `tokens` the input tokens it was given.
    """

    def __init__(self) -> None:
        # What the scheduler reads of a model runner without a model.
        self.model_runner = SimpleNamespace(attn_backend=object(), prefill_aware_swa=False)
        self.forwards = 0
        self.tokens = 0

    def forward_batch_generation(self, batch: Any, **kwargs: object) -> object:
        """One forward of `batch`: each row's next token, as SGLang's result type."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        input_ids = batch.input_ids
        if input_ids is None:
            raise ValueError("the scheduler launched a batch without its input ids")
        seq_lens = batch.seq_lens.to(torch.long)
        if batch.forward_mode.is_extend():
            # Flat over the rows' extend segments: each row's last token ends its segment.
            ends = torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.long), 0) - 1
            last = input_ids.reshape(-1)[ends]
        else:
            last = input_ids.reshape(-1)
        if len(last) != len(seq_lens):
            raise ValueError(f"{len(last)} input rows for a batch of {len(seq_lens)}")
        self.forwards += 1
        self.tokens += int(input_ids.numel())
        tokens = next_token(last, seq_lens - 1).to(torch.int32)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=tokens,
            can_run_cuda_graph=False,
        )
