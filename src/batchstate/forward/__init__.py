"""A forward's inputs, built from host mirrors in one upload, hybrid models' included."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.forward.anchor_copies import CachedCopies
    from batchstate.forward.contract import check_forward
    from batchstate.forward.hybrid import HybridInputs, StateInputs, WindowInputs, hybrid_inputs
    from batchstate.forward.inputs import ForwardInputs, ForwardPhase, forward_inputs
    from batchstate.forward.speculative_states import StateCopies, accepted_states
    from batchstate.forward.transfer import TransferTargets, transfer_targets

__all__ = [
    "CachedCopies",
    "ForwardInputs",
    "ForwardPhase",
    "HybridInputs",
    "StateCopies",
    "StateInputs",
    "TransferTargets",
    "WindowInputs",
    "accepted_states",
    "check_forward",
    "forward_inputs",
    "hybrid_inputs",
    "transfer_targets",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
