"""The state copies a verify forward's recurrent layers need once the accepted drafts are known.

A recurrent layer that verifies drafts ends at the state after the last
accepted one, which only the device knows when the forward runs. The
model here is a checkpoint per draft position: the verify forward writes
the state after each of its query tokens into a checkpoint buffer indexed
by the token's place in the forward (`ForwardInputs` order), and keeps the
row's state slot as it was. Row `i` accepted `a` drafts ends at the state
after its query token `a` (token 0 is its decode token), so its slot takes
`checkpoints[qo_indptr[i] + a]`: one gather and one scatter on the device,
named here, with no read (the counts may still be on the device).
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import DraftError
from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import DeviceOnly, Mirrored
from batchstate.forward.hybrid import HybridInputs
from batchstate.forward.inputs import ForwardInputs, ForwardInputsError

__all__ = ["StateCopies", "accepted_states"]


@final
@attrs.frozen(eq=False, repr=False)
class StateCopies:
    """Device copies of recurrent states: `states[targets[i]] = checkpoints[sources[i]]`.

    Args:
        sources: device int64 `[num_rows]`, each row's accepted checkpoint
            (a query token's place in the verify forward).
        targets: int64 `[num_rows]`, each row's state slot.
    """

    sources: DeviceOnly
    targets: Mirrored

    def __repr__(self) -> str:
        return f"StateCopies(num_rows={len(self.targets)})"


def accepted_states(
    inputs: ForwardInputs,
    hybrid: HybridInputs,
    num_accepted: torch.Tensor | npt.NDArray[np.integer],
) -> StateCopies:
    """The copies that leave each row's state slot at its last accepted token.

    For a verify forward whose recurrent layers wrote the state after each
    query token into `checkpoints[token]`: row `i` takes
    `checkpoints[qo_indptr[i] + num_accepted[i]]`. Computed on the device
    from the counts the verify forward wrote (one add), or uploaded from
    counts the host has: nothing is read. Apply the copies after the verify
    forward and before the row's next forward (under overlap, the next
    window's forward reads the copied state: same stream, so in order).

    Args:
        inputs: the verify forward's inputs (`forward_inputs` of the `Verifying`).
        hybrid: `hybrid_inputs(inputs, pools)` of the same forward.
        num_accepted: int32 or int64 `[num_rows]` on the inputs' device, as
            `sync` takes them, or the same counts as a 1-D numpy integer array.

    Raises:
        ForwardInputsError: `hybrid` is another forward's, or its pools keep no state.
        DraftError: `num_accepted` of the wrong type, shape, dtype or device,
            or a host count outside `[0, query tokens - 1]`.
    """
    expect_instance(inputs, ForwardInputs, "accepted_states: inputs")
    expect_instance(hybrid, HybridInputs, "accepted_states: hybrid")
    if not hybrid.states or hybrid.num_rows != inputs.num_rows:
        raise ForwardInputsError(
            "accepted_states: hybrid must be hybrid_inputs of the same forward, on pools"
            " that keep a RecurrentState"
        )
    num_rows, device = inputs.num_rows, inputs.device
    starts = inputs.qo_indptr.host[:-1].astype(np.int64)
    if isinstance(num_accepted, np.ndarray):
        if num_accepted.dtype.kind not in "iu" or num_accepted.shape != (num_rows,):
            raise DraftError(
                f"num_accepted: expected integers [{num_rows}], got {num_accepted.dtype}"
                f" {list(num_accepted.shape)}"
            )
        bad = (num_accepted < 0) | (num_accepted >= inputs.extend_lens.host)
        if bad.any():
            raise DraftError(f"num_accepted: row {int(bad.argmax())} accepted more than it drafted")
        sources = DeviceOnly.from_host(starts + num_accepted.astype(np.int64), device)
    elif not isinstance(num_accepted, torch.Tensor):
        raise DraftError(
            f"num_accepted must be a torch tensor on {device} or a numpy array, got"
            f" {type(num_accepted).__name__}"
        )
    elif (
        num_accepted.shape != (num_rows,)
        or num_accepted.dtype not in (torch.int32, torch.int64)
        or num_accepted.device != device
    ):
        raise DraftError(
            f"num_accepted: expected int32 or int64 [{num_rows}] on {device}, got"
            f" {num_accepted.dtype} {list(num_accepted.shape)} on {num_accepted.device}"
        )
    else:
        # NOTE: the one device op: the row offsets (device side of a mirror) plus the counts.
        offsets = inputs.qo_indptr.device[:-1].to(torch.int64)
        sources = DeviceOnly(offsets + num_accepted.to(torch.int64))
    return StateCopies(sources, hybrid.states[0].state_indices)
