"""What mypy must reject: a padded forward's output reaching sampling without `unpad`.

The output is a `PaddedOutput`, which no sampler takes, and the attribute that
holds its tensor is typed `object`: the one path to a tensor is `unpad` (or
`unpad_tokens`), short of an `isinstance` check or a `cast`, which say so.
"""

from __future__ import annotations

import functools
import textwrap
from typing import Final

import pytest

from tests.typecheck import mypy_errors

_PRELUDE: Final = """\
import torch
from batchstate import *
from batchstate.captured import *
from batchstate.checks import *
from batchstate.columns import *
from batchstate.errors import *
from batchstate.forward import *
from batchstate.memory import *
from batchstate.records import *
from batchstate.speculative import *
from batchstate.transitions import *

def sample(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)

def forward(inputs: ForwardInputs) -> torch.Tensor:
    return inputs.positions.device

def snippet(padded: Padded, inputs: ForwardInputs) -> None:
"""

REJECTED: Final = {
    "reject_sampling_a_padded_output": ("sample(padded.run(forward))", "[arg-type]"),
    "reject_slicing_a_padded_output": ("print(padded.run(forward)[0])", "[index]"),
    "reject_padded_as_inputs": ("forward(padded)", "[arg-type]"),
    "reject_pad_result_as_padded": ("p: Padded = pad(inputs, [8])", "[assignment]"),
    # The attribute that holds the tensor is typed `object`: no path to a sampler but unpad.
    "reject_sampling_the_held_tensor": ("sample(padded.run(forward)._tensor)", "[arg-type]"),
    "reject_slicing_the_held_tensor": ("print(padded.run(forward)._tensor[:2])", "[index]"),
}
ACCEPTED: Final = {
    "accept_unpad_then_sample": "sample(unpad(padded.run(forward)))",
    # What still reaches it, on purpose: a check that says the value is a tensor.
    "accept_an_explicit_isinstance": (
        "held = padded.run(forward)._tensor\nassert isinstance(held, torch.Tensor)\nsample(held)"
    ),
    "accept_unpad_tokens": "print(unpad_tokens(padded.wrap(forward(padded.inputs))).shape)",
    "accept_pad_then_unwrap": "print(pad(inputs, [8, 16], SGLANG_PAD_VALUES).unwrap().padded_rows)",
}


@functools.cache
def _errors() -> dict[str, list[str]]:
    cases = {name: body for name, (body, _) in REJECTED.items()} | ACCEPTED
    return mypy_errors(
        {name: _PRELUDE + textwrap.indent(body, "    ") + "\n" for name, body in cases.items()}
    )


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected(name: str) -> None:
    """mypy rejects it with the expected error code."""
    errors = _errors()[name]
    assert any(REJECTED[name][1] in error for error in errors), errors


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted(name: str) -> None:
    """mypy accepts it."""
    assert _errors()[name] == []
