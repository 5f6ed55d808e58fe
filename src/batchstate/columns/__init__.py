"""Per-row columns a scheduler declares once (sampling parameters...), carried everywhere."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.columns.building import build_columns
    from batchstate.columns.columns import Columns, HostColumn, NoColumns
    from batchstate.columns.sampling import Sampling
    from batchstate.columns.sampling_params import GREEDY, SamplingParams

__all__ = [
    "GREEDY",
    "Columns",
    "HostColumn",
    "NoColumns",
    "Sampling",
    "SamplingParams",
    "build_columns",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
