"""The prefix cache: a radix tree of reference-counted KV pages, and a hybrid model's anchors."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.cache.anchors import HybridCache, ResumePoint
    from batchstate.cache.anchors import ResumePoint as Anchor
    from batchstate.cache.prefix_cache import PrefixCache

__all__ = [
    "HybridCache",
    "PrefixCache",
    "ResumePoint",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["Anchor"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "Anchor": "batchstate.cache.ResumePoint",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
