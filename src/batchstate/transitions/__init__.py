"""The transitions: pure functions from records and pools to new records and pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.records.mixed import finish_mixed
    from batchstate.records.mixed import finish_mixed as settle
    from batchstate.transitions.admission import admit_prefilled, extend, idle
    from batchstate.transitions.admission import admit_prefilled as prebuilt
    from batchstate.transitions.decoding import decode
    from batchstate.transitions.filtering import Departed, Split, filter_batch, keep_indices, split
    from batchstate.transitions.merging import merge
    from batchstate.transitions.mixing import decode_sampled, mix
    from batchstate.transitions.releasing import release
    from batchstate.transitions.sampled import (
        Sampled,
        gather_sampled,
        join_sampled,
        read_sampled,
    )
    from batchstate.transitions.sampled import gather_sampled as follow

__all__ = [
    "Departed",
    "Sampled",
    "Split",
    "admit_prefilled",
    "decode",
    "decode_sampled",
    "extend",
    "filter_batch",
    "finish_mixed",
    "gather_sampled",
    "idle",
    "join_sampled",
    "keep_indices",
    "merge",
    "mix",
    "read_sampled",
    "release",
    "split",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["follow", "prebuilt", "settle"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "follow": "batchstate.transitions.gather_sampled",
    "prebuilt": "batchstate.transitions.admit_prefilled",
    "settle": "batchstate.transitions.finish_mixed",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
