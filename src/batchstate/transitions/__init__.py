"""The transitions: pure functions from records and pools to new records and pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.records.mixed import settle
    from batchstate.transitions.admission import extend, idle, prebuilt
    from batchstate.transitions.decoding import decode
    from batchstate.transitions.filtering import Departed, Split, filter_batch, keep_indices, split
    from batchstate.transitions.merging import merge
    from batchstate.transitions.mixing import decode_sampled, mix
    from batchstate.transitions.releasing import release
    from batchstate.transitions.sampled import Sampled, follow, join_sampled, read_sampled

__all__ = [
    "Departed",
    "Sampled",
    "Split",
    "decode",
    "decode_sampled",
    "extend",
    "filter_batch",
    "follow",
    "idle",
    "join_sampled",
    "keep_indices",
    "merge",
    "mix",
    "prebuilt",
    "read_sampled",
    "release",
    "settle",
    "split",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
