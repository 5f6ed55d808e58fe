"""SGLang reads its configuration from a published process-wide context: publish one.

`sglang.test.test_utils.published_topology` does the same, but importing that module
pulls in SGLang's benchmark datasets; this is its six lines without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from batchstate.sglang._stubs import install_stubs


@contextlib.contextmanager
def cpu_topology(**server_args: object) -> Iterator[object]:
    """Publish SGLang server arguments for a single CPU rank; reset them on exit."""
    install_stubs()
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    fields = {"device": "cpu", "attention_backend": "torch_native", **server_args}
    args = ServerArgs(model_path="dummy", **fields)
    reset_context()
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield args
    finally:
        reset_context()
