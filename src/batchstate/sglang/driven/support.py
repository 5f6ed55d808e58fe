"""What drive mode runs: the SGLang version and server configurations it accepts, checked
at start.

Drive mode replaces SGLang's batch state and memory with batchstate's; a feature
whose state batchstate does not model (speculative decoding's draft window, a
hierarchical cache's host copies, mixed prefill and decode in one forward, ...)
would run against memory batchstate does not hold. So every such configuration is
refused before the scheduler serves a request, with one line naming the flag,
never part way through a run. `check_drive` is the check;
`python -m batchstate.sglang.driven.support SERVER_ARGS` runs it on
`sglang.launch_server`'s own arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import attrs

from batchstate.errors import Error
from batchstate.sglang._fields import SUPPORTED_VERSIONS, installed_version

__all__ = ["REFUSED", "DriveRefused", "Refusal", "check_drive", "main"]


class DriveRefused(Error, ValueError):
    """Drive mode does not run this SGLang version or server configuration: one line
    naming it."""


@attrs.frozen
class Refusal:
    """A server configuration drive mode refuses: the `ServerArgs` field, SGLang's flag
    for it, whether a value turns on what drive does not run, and why."""

    field: str
    flag: str
    refused: Callable[[object], bool]
    why: str


def _on(value: object) -> bool:
    return bool(value)


def _above_one(value: object) -> bool:
    return isinstance(value, int) and value > 1


def _set(value: object) -> bool:
    return value is not None and value != "null"


REFUSED: tuple[Refusal, ...] = (
    Refusal(
        "speculative_algorithm",
        "--speculative-algorithm",
        _set,
        "a draft window's rows and lengths are not driven",
    ),
    Refusal(
        "disable_radix_cache",
        "--disable-radix-cache",
        _on,
        "drive presents batchstate's prefix cache as SGLang's radix cache",
    ),
    Refusal(
        "enable_mixed_chunk",
        "--enable-mixed-chunk",
        _on,
        "mix_with_running is not driven yet",
    ),
    Refusal(
        "enable_hierarchical_cache",
        "--enable-hierarchical-cache",
        _on,
        "host-memory copies of the cache are not modelled",
    ),
    Refusal("enable_lmcache", "--enable-lmcache", _on, "an external KV store is not modelled"),
    Refusal("enable_hisparse", "--enable-hisparse", _on, "sparse KV offload is not modelled"),
    Refusal(
        "enable_session_radix_cache",
        "--enable-session-radix-cache",
        _on,
        "session caches are not modelled",
    ),
    Refusal(
        "disaggregation_mode",
        "--disaggregation-mode",
        _set,
        "prefill/decode transfer queues are not driven",
    ),
    Refusal(
        "enable_dp_attention",
        "--enable-dp-attention",
        _on,
        "data-parallel attention batches are not driven",
    ),
    Refusal("dp_size", "--dp-size", _above_one, "one scheduler per process is driven, not a set"),
    Refusal("tp_size", "--tp-size", _above_one, "only one tensor-parallel rank has been driven"),
    Refusal("pp_size", "--pp-size", _above_one, "pipeline micro-batches are not driven"),
    Refusal("enable_lora", "--enable-lora", _on, "LoRA adapter slots are not modelled"),
    Refusal(
        "enable_priority_scheduling",
        "--enable-priority-scheduling",
        _on,
        "priority preemption is not driven",
    ),
    Refusal(
        "num_continuous_decode_steps",
        "--num-continuous-decode-steps",
        _above_one,
        "several decodes per schedule are not driven",
    ),
    Refusal(
        "enable_two_batch_overlap",
        "--enable-two-batch-overlap",
        _on,
        "split micro-batches are not driven",
    ),
    Refusal("enable_pdmux", "--enable-pdmux", _on, "split prefill/decode streams are not driven"),
    Refusal("dllm_algorithm", "--dllm-algorithm", _set, "diffusion decoding is not driven"),
)
"""Every server configuration drive mode refuses, in the order `check_drive` checks them."""


def check_drive(server_args: object, version: str | None = None) -> None:
    """Raise `DriveRefused` (one line) unless drive mode runs SGLang `version` (the
    installed one by default) with these `ServerArgs`; reads them only."""
    found = installed_version() if version is None else version
    if found not in SUPPORTED_VERSIONS:
        raise DriveRefused(
            f"batchstate drive mode runs SGLang {', '.join(SUPPORTED_VERSIONS)}, not SGLang {found}"
        )
    for refusal in REFUSED:
        if not hasattr(server_args, refusal.field):
            raise DriveRefused(
                f"SGLang's ServerArgs has no field {refusal.field!r}: drive mode reads "
                f"SGLang {', '.join(SUPPORTED_VERSIONS)}'s"
            )
        value = getattr(server_args, refusal.field)
        if refusal.refused(value):
            raise DriveRefused(
                f"batchstate drive mode does not run {refusal.flag} {value!r}: {refusal.why}"
            )


def main(argv: list[str] | None = None) -> int:
    """Check `sglang.launch_server`'s arguments: 0 when drive runs them, else 2 and the
    refusal's line on stderr."""
    from batchstate.sglang._stubs import install_stubs

    install_stubs()
    from sglang.srt.server_args import prepare_server_args

    args = sys.argv[1:] if argv is None else argv
    try:
        check_drive(prepare_server_args(args))
    except DriveRefused as refused:
        print(refused, file=sys.stderr)
        return 2
    print("batchstate drive mode runs this SGLang and configuration")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
