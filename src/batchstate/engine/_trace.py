"""What the engine records per step, for the summary and the plot."""

from __future__ import annotations

from typing import final

__all__ = ["Trace"]


@final
class Trace:
    """Per-step columns (appended to, one entry per step) and run-wide counters.

    Audited steps ran their decode-path bookkeeping under the device-read
    counter, which slows every op: the per-step bookkeeping average leaves
    them out.
    """

    def __init__(self) -> None:
        self.is_extend: list[bool] = []
        self.batch_size: list[int] = []  # rows in the step's forward
        self.kv_tokens_used: list[int] = []  # owned KV tokens (whole pages) after the step
        self.step_s: list[float] = []  # wall time of the whole step
        self.bookkeeping_s: list[float] = []  # time inside batchstate transitions
        self.audited: list[bool] = []
        self.num_retractions = 0
        self.device_reads = 0  # counted on audited steps' decode path
        self.num_checks = 0  # invariant checks that passed
        self.prefill_computed = 0  # input ids the extends computed
        self.prefill_cached = 0  # input ids the extends read from the prefix cache instead
        self.cache_hits = 0  # requests extended with a cached prefix
        self.extended_requests = 0  # requests extended (a retracted one again)
        self.evicted_pages = 0  # cached pages evicted to make room
        # KV tokens of pages rows computed though the cache held them, freed at the prefill's end
        self.duplicate_tokens_freed = 0
        self.num_chunks = 0  # forwards' rows that stopped part way through a prompt
        self.num_mixed_steps = 0  # forwards with prompt tokens and decode rows together
        self.named_reads = 0  # read_sampled (one per mixed step) and, under overlap, read_verified
        self.overshoot_tokens = 0  # overlap: tokens decoded past a stop, then dropped
        self.idle_steps = 0  # steps run with no rows (data-parallel ranks with nothing to do)
        self.prebuilt_requests = 0  # requests admitted with KV prefilled elsewhere
        self.prebuilt_steps = 0  # steps that admitted them (no forward of their own)
        self.speculative_steps = 0  # decode steps that verified drafts
        self.drafted_tokens = 0  # draft tokens proposed and verified
        self.accepted_drafts = 0  # of which, accepted by the target

    def __len__(self) -> int:
        return len(self.step_s)

    def append(
        self,
        *,
        is_extend: bool,
        batch_size: int,
        kv_tokens_used: int,
        step_s: float,
        bookkeeping_s: float,
        audited: bool,
    ) -> None:
        """Record one step."""
        self.is_extend.append(is_extend)
        self.batch_size.append(batch_size)
        self.kv_tokens_used.append(kv_tokens_used)
        self.step_s.append(step_s)
        self.bookkeeping_s.append(bookkeeping_s)
        self.audited.append(audited)

    @property
    def num_audited(self) -> int:
        return sum(self.audited)

    def forward_sizes(self) -> list[int]:
        """Rows per forward: the steps that ran one (prebuilt and idle steps run none)."""
        return [size for size in self.batch_size if size]

    def bookkeeping_us_per_step(self) -> tuple[float, float]:
        """Mean and median bookkeeping time of the unaudited steps, in µs (0 when none)."""
        times = sorted(
            t for t, audited in zip(self.bookkeeping_s, self.audited, strict=True) if not audited
        )
        if not times:
            return 0.0, 0.0
        return 1e6 * sum(times) / len(times), 1e6 * times[len(times) // 2]
