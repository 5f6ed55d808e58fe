"""What mypy must reject: the verify window used where a mirrored record is needed."""

from __future__ import annotations

import functools
import textwrap
from typing import Final

import pytest

from tests.typecheck import mypy_errors

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

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
from batchstate.audit import device_reads

def snippet(
    decoding: Decoding, filtered: Filtered, verifying: Verifying, pools: Pools,
    tensor: torch.Tensor, ahead: WindowAhead,
) -> None:
"""

# Each case, and the error code it must fail with.
REJECTED: Final = {
    # Every mirrored transition refuses the window: its lengths exist only on the device.
    "reject_decode_verifying": ("decode(verifying, pools)", "[arg-type]"),
    "reject_filter_verifying": ("filter_batch(verifying, [0])", "[arg-type]"),
    "reject_merge_into_verifying": ("merge(verifying, filtered)", "[arg-type]"),
    "reject_merge_verifying_in": ("merge(filtered, verifying)", "[arg-type]"),
    "reject_check_batch_verifying": ("check_batch(verifying)", "[arg-type]"),
    "reject_verifying_as_batch": ("batch: Batch = verifying", "[assignment]"),
    # No host length to read, stale or otherwise.
    "reject_rows_on_verifying": ("print(verifying.rows)", "[attr-defined]"),
    "reject_host_seq_lens": ("print(verifying.seq_lens.host)", "[attr-defined]"),
    "reject_seq_lens_sum": ("print(verifying.seq_lens_sum)", "[attr-defined]"),
    "reject_seq_lens_as_mirror": (
        "def plan(seq_lens: Mirrored) -> None: ...\nplan(verifying.seq_lens)",
        "[arg-type]",
    ),
    # verify starts from Decoding only; sync leaves the window only.
    "reject_verify_filtered": ("verify(filtered, [0], pools)", "[arg-type]"),
    "reject_verify_verifying": ("verify(verifying, [0], pools)", "[arg-type]"),
    "reject_sync_decoding": ("sync(decoding, tensor, pools)", "[arg-type]"),
    # A window opened ahead: lengths known only as an upper bound refuse exact-length code.
    "reject_forward_inputs_ahead": ("forward_inputs(ahead, pools.table, 1)", "[call-overload]"),
    "reject_sync_ahead": ("sync(ahead, tensor, pools)", "[arg-type]"),
    "reject_decode_ahead": ("decode(ahead, pools)", "[arg-type]"),
    "reject_verify_ahead_of_ahead": ("verify_ahead(ahead, tensor, [1], pools)", "[arg-type]"),
    "reject_bound_as_host": ("print(ahead.seq_lens.host)", "[attr-defined]"),
    "reject_bound_as_mirror": (
        "def plan(seq_lens: Mirrored) -> None: ...\nplan(ahead.seq_lens)",
        "[arg-type]",
    ),
    "reject_device_counts_to_exact_window": ("exact_window(ahead, tensor, pools)", "[arg-type]"),
    "reject_ahead_as_batch": ("batch: Batch = ahead", "[assignment]"),
    # verify can fail: its Result must be unwrapped first.
    "reject_verify_result_as_step": ("print(verify(decoding, [0], pools).batch)", "[attr-defined]"),
}

ACCEPTED: Final = {
    "accept_overlapped_speculation": """\
        opened, pools = verify_ahead(verifying, tensor, [2], pools).unwrap()
        bound: UpperBound = opened.seq_lens
        widest: int = bound.max_bound
        verified = read_verified(tensor, tensor[:, None])
        window, pools = exact_window(opened, verified.counts, pools)
        running, pools = sync(window, verified.counts, pools)
    """,
    "accept_speculative_step": """\
        verifying, reserved = verify(decoding, [2], pools).unwrap()
        accepted = torch.zeros(1, dtype=torch.int64)
        running, pools = sync(verifying, accepted, reserved)
        total: int = running.rows.seq_lens_sum
        step, pools = decode(running, pools).unwrap()
        check_batch(step)
    """,
    # A window given up before sync is released like any holder of slots.
    "accept_release_verifying": """\
        pools = release(verifying, filtered, pools).unwrap()
        check_pools(pools, [filtered])
    """,
    "accept_audited_sync": """\
        with device_reads(forbid=True) as log:
            running, pools = sync(verifying, tensor, pools)
        count: int = log.report().count
    """,
}


def _module(body: str) -> str:
    lines = textwrap.dedent(body).strip("\n")
    return _PRELUDE + textwrap.indent(lines, "    ") + "\n"


@functools.cache
def _errors() -> dict[str, list[str]]:
    modules = {name: _module(code) for name, (code, _) in REJECTED.items()}
    modules |= {name: _module(code) for name, code in ACCEPTED.items()}
    return mypy_errors(modules)


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_mypy_rejects(name: str) -> None:
    """mypy reports the intended error where the verify window meets mirrored code."""
    code, reason = REJECTED[name]
    errors = _errors()[name]
    assert any(reason in error for error in errors), f"{name}: {errors}\n{code}"


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_mypy_accepts(name: str) -> None:
    """mypy accepts the speculative step: verify, sync, then the mirrored transitions."""
    assert _errors()[name] == [], _errors()[name]
