"""The end-of-run summary: one record, rendered as a table or as JSON."""

from __future__ import annotations

from typing import Any, final

import attrs

from batchstate.engine._simulate import Simulation, describe_pools
from batchstate.engine._simulation_config import SimulationConfig

__all__ = ["Summary", "modes_line", "render_summary", "run_modes", "summarize"]


@final
@attrs.frozen
class Summary:
    """The numbers of one run; `ok` is False when a check failed (see `ok`)."""

    device: str
    page_size: int
    num_requests: int
    num_finished: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    extend_steps: int
    decode_steps: int
    retractions: int
    chunks: int  # rows that stopped part way through a prompt
    mixed_steps: int  # forwards with prompt tokens and decode rows together
    named_reads_per_step: float  # read_sampled calls per step: 1 in mix modes, 0 otherwise
    overshoot_tokens: int  # overlap: tokens decoded past a stop, then dropped
    wall_s: float
    steps_per_s: float
    tokens_per_s: float  # generated tokens per second of the engine loop
    bookkeeping_us_per_step: float  # mean inside batchstate calls, unaudited steps
    bookkeeping_us_median: float
    device_reads: int | None  # on audited steps' decode path; None: not measured
    audited_steps: int
    invariant_checks: int
    pools_conserved: bool
    pools: str
    oracle: str  # "pass (...)", "FAIL (...)" or "skipped (...)"
    oracle_passed: bool | None  # None: the oracle did not run
    oracle_s: float | None  # None: the oracle did not run
    prefix_cache: bool = False
    # The step's modes as configured (`run_modes`); the counts say what they did.
    # "hybrid": some layer keeps window pages or a recurrent state; "llama", "qwen3": a
    # transformers architecture (the `--model` option's value, in every case)
    model: str = "full"
    chunk_size: int = 0  # prompt tokens per step; 0: whole prompts
    mixed: bool = False  # prompt chunks run beside the decode rows, in one forward
    overlap: bool = False  # sampled tokens stay on the device; finishes checked a step late
    shares_prefixes: bool = False  # the workload has shared prefixes or follow-up turns
    prefill_computed: int = 0  # input ids the extends computed
    prefill_cached: int = 0  # input ids read from the prefix cache instead
    cache_hits: int = 0  # extended requests that read a cached prefix
    extended_requests: int = 0  # requests extended (retracted ones count again)
    evicted_pages: int = 0
    duplicate_tokens_freed: int = 0  # KV computed though cached, freed at the prefill's end
    step_ms: float = 0.0  # mean wall time per step
    sampling: str = "greedy"  # the workload's sampling mix, and how many requests sampled
    prebuilt_requests: int = 0  # admitted with KV and first token from a prefill server
    prebuilt_steps: int = 0  # steps that admitted them; no forward (not extend, not decode)
    speculative: int = 0  # draft tokens per step asked for (0: off)
    speculative_steps: int = 0  # decode steps that verified drafts
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    cuda_graph_sizes: tuple[int, ...] = ()  # every forward padded to the next; () none
    padded_rows_per_step: float = 0.0  # rows added by padding, per forward
    padded_tokens_per_step: float = 0.0  # tokens added by padding, per forward
    eager_forwards: int = 0  # forwards larger than every size, run unpadded
    # What a user feels: how many requests run together, and how much of the KV pool they hold.
    mean_batch_size: float = 0.0  # rows per forward, over the steps that ran one
    max_batch_size: int = 0
    mean_kv_use: float = 0.0  # share of the pool's KV tokens held by requests after a step
    peak_kv_use: float = 0.0

    @property
    def ok(self) -> bool:
        """Pools conserved, the oracle (when it ran) passed, no decode-path device read counted."""
        return (
            self.pools_conserved
            and self.oracle_passed is not False
            and not self.device_reads  # None (not counted) or 0
        )


def summarize(run: Simulation) -> Summary:
    """The summary of a finished run."""
    trace, pools = run.trace, run.pools
    generated = sum(len(tokens) for tokens in run.outputs.values())
    sizes, used = trace.forward_sizes(), trace.kv_tokens_used
    capacity = max(pools.num_pages * pools.page_size, 1)
    steps = len(trace)
    wall = max(run.wall_s, 1e-9)
    if run.oracle is not None:
        oracle = str(run.oracle)
    elif run.config.device == "meta":
        oracle = "skipped (meta runs no model)"
    else:
        oracle = "skipped (--no-oracle)"
    return Summary(
        device=run.config.device,
        page_size=pools.page_size,
        num_requests=len(run.specs),
        num_finished=len(run.outputs),
        prompt_tokens=sum(len(spec.prompt) for spec in run.specs),
        generated_tokens=generated,
        steps=steps,
        extend_steps=sum(trace.is_extend),
        decode_steps=steps - sum(trace.is_extend) - trace.prebuilt_steps,
        retractions=trace.num_retractions,
        chunks=trace.num_chunks,
        mixed_steps=trace.num_mixed_steps,
        named_reads_per_step=trace.named_reads / max(steps, 1),
        overshoot_tokens=trace.overshoot_tokens,
        wall_s=run.wall_s,
        steps_per_s=steps / wall,
        tokens_per_s=generated / wall,
        bookkeeping_us_per_step=trace.bookkeeping_us_per_step()[0],
        bookkeeping_us_median=trace.bookkeeping_us_per_step()[1],
        device_reads=trace.device_reads if run.reads_measured else None,
        audited_steps=trace.num_audited,
        invariant_checks=trace.num_checks,
        pools_conserved=run.pools_conserved,
        pools=describe_pools(pools),
        oracle=oracle,
        oracle_passed=None if run.oracle is None else run.oracle.passed,
        oracle_s=run.oracle_s,
        prefix_cache=run.config.prefix_cache,
        **run_modes(run.config),
        shares_prefixes=bool(run.config.workload.shared_prefixes or run.config.workload.follow_ups),
        prefill_computed=trace.prefill_computed,
        prefill_cached=trace.prefill_cached,
        cache_hits=trace.cache_hits,
        extended_requests=trace.extended_requests,
        evicted_pages=trace.evicted_pages,
        duplicate_tokens_freed=trace.duplicate_tokens_freed,
        step_ms=1e3 * sum(trace.step_s) / max(steps, 1),
        sampling=_sampling_line(run),
        prebuilt_requests=trace.prebuilt_requests,
        prebuilt_steps=trace.prebuilt_steps,
        speculative=run.config.engine.speculative,
        speculative_steps=trace.speculative_steps,
        drafted_tokens=trace.drafted_tokens,
        accepted_drafts=trace.accepted_drafts,
        mean_batch_size=sum(sizes) / max(len(sizes), 1),
        max_batch_size=max(sizes, default=0),
        mean_kv_use=sum(used) / max(len(used), 1) / capacity,
        peak_kv_use=max(used, default=0) / capacity,
        **_padding(run),
    )


def run_modes(config: SimulationConfig) -> dict[str, Any]:
    """The step's modes a summary reports, as `config` set them: model, chunks, mixed, overlap."""
    engine = config.engine
    model = config.model
    tiny = "hybrid" if model.is_hybrid else "full"
    return {
        "model": tiny if model.architecture == "tiny" else model.architecture,
        "chunk_size": engine.chunk_size,
        "mixed": engine.mixed,
        "overlap": engine.overlap,
    }


def modes_line(model: str, chunk_size: int, *, mixed: bool, overlap: bool) -> str:
    """The modes in words: `full model; chunks of 32 tokens, mixed steps off, overlap on`."""
    chunks = f"chunks of {chunk_size} tokens" if chunk_size else "whole prompts"
    return f"{model} model; {chunks}, mixed steps {_on(mixed)}, overlap {_on(overlap)}"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _padding(run: Simulation) -> dict[str, Any]:
    feeder = run.feeder
    if feeder is None or not feeder.sizes:
        return {}
    forwards = max(feeder.forwards, 1)
    return {
        "cuda_graph_sizes": feeder.sizes,
        "padded_rows_per_step": feeder.padded_rows / forwards,
        "padded_tokens_per_step": feeder.padded_tokens / forwards,
        "eager_forwards": feeder.eager_forwards,
    }


def _sampling_line(run: Simulation) -> str:
    workload = run.config.workload
    sampled = [spec.sampling for spec in run.specs if spec.sampling.temperature]
    line = f"{workload.sampling}: {len(run.specs) - len(sampled)} greedy, {len(sampled)} sampled"
    if workload.sampling == "fixed" and sampled:
        p = workload.fixed_sampling
        line += f" (temperature {p.temperature}, top-p {p.top_p}, top-k {p.top_k}, min-p {p.min_p})"
    elif sampled:
        temperatures = sorted({p.temperature for p in sampled})
        filtered = sum(1 for p in sampled if p.top_k or p.top_p < 1 or p.min_p)
        line += (
            f" (temperature {temperatures[0]}-{temperatures[-1]},"
            f" {filtered} with top-k, top-p or min-p)"
        )
    return line + (", each from its own seeded stream" if sampled else "")


def render_summary(summary: Summary) -> str:
    """The summary as an aligned two-column table.

    >>> print(render_summary(_EXAMPLE).splitlines()[3])
    requests            256 finished / 256
    """
    s = summary
    if s.device_reads is None:
        # The first step is always audited (unless --audit-every is 0), and every request
        # takes a step: with no step, the workload had no requests.
        why = "--audit-every 0" if s.steps else "no step ran: the workload has no requests"
        reads = f"not counted ({why})"
    else:
        reads = f"{s.device_reads} in {s.audited_steps} audited steps"
        if s.device == "cpu":
            reads += ", trivially: on cpu all data is host data"
    oracle_time = "" if s.oracle_s is None else f"; oracle {s.oracle_s:.2f} s more"
    rows = (
        ("device", f"{s.device}, page size {s.page_size}"),
        ("modes", modes_line(s.model, s.chunk_size, mixed=s.mixed, overlap=s.overlap)),
        ("requests", f"{s.num_finished} finished / {s.num_requests}"),
        ("tokens", f"{s.prompt_tokens} prompt, {s.generated_tokens} generated"),
        (
            "steps",
            f"{s.steps} ({s.extend_steps} extend, {s.decode_steps} decode"
            + (f", {s.prebuilt_steps} prebuilt)" if s.prebuilt_steps else ")"),
        ),
        (
            "batch size",
            f"{s.mean_batch_size:.1f} rows per forward on average, {s.max_batch_size} at most",
        ),
        (
            "KV in use",
            f"{100 * s.mean_kv_use:.0f}% of the pool on average,"
            f" {100 * s.peak_kv_use:.0f}% at peak (held by requests, cached pages not counted)",
        ),
        ("retractions", f"{s.retractions}"),
        (
            "chunks, mixed",
            f"{s.chunks} partial prefills, {s.mixed_steps} mixed steps,"
            f" {s.overshoot_tokens} tokens past a stop (overlap)",
        ),
        ("wall time", f"{s.wall_s:.2f} s (engine loop{oracle_time})"),
        ("steps/s", f"{s.steps_per_s:.0f}"),
        ("tokens/s", f"{s.tokens_per_s:.0f} generated"),
        (
            "bookkeeping",
            f"{s.bookkeeping_us_per_step:.0f} µs per step, median {s.bookkeeping_us_median:.0f}"
            " (batchstate calls)",
        ),
        (
            "device reads",
            f"{reads} (decode path); {s.named_reads_per_step:.2f} named reads per step"
            " (read_sampled)",
        ),
        ("invariant checks", f"{s.invariant_checks} passed"),
        ("pool conservation", f"{'ok' if s.pools_conserved else 'LEAK'}: {s.pools}"),
        ("prefix cache", _cache_line(s)),
        ("prefill", _prefill_line(s)),
        ("sampling", s.sampling),
        (
            "prebuilt",
            f"{s.prebuilt_requests} requests arrived prefilled (KV and first token transferred)",
        ),
        ("speculative", _speculative_line(s)),
        ("cuda graphs", _graphs_line(s)),
        ("oracle", s.oracle),
    )
    width = max(len(name) for name, _ in rows)
    lines = [f"{'batchstate simulate':<{width}}   {'OK' if s.ok else 'FAILED'}"]
    lines += [f"{name:<{width}}   {value}" for name, value in rows]
    return "\n".join(lines)


def _graphs_line(s: Summary) -> str:
    if not s.cuda_graph_sizes:
        return "off: forwards run at their own sizes (see --cuda-graph-sizes)"
    sizes = " ".join(map(str, s.cuda_graph_sizes))
    return (
        f"padded to sizes {sizes}: {s.padded_rows_per_step:.2f} rows and"
        f" {s.padded_tokens_per_step:.2f} tokens added per forward;"
        f" {s.eager_forwards} forwards over the largest size ran unpadded"
    )


def _cache_line(s: Summary) -> str:
    if not s.prefix_cache:
        return "off (--no-prefix-cache)"
    rate = 100 * s.cache_hits / max(s.extended_requests, 1)
    line = (
        f"on: {s.cache_hits}/{s.extended_requests} prefills hit ({rate:.0f}%),"
        f" {s.evicted_pages} pages evicted, {s.duplicate_tokens_freed} duplicate tokens freed"
    )
    if not s.shares_prefixes:
        # Hits can still happen (random prompts that agree on a page); they are chance.
        line += " (the workload shares no prefix by design; see --shared-prefix, --follow-ups)"
    return line


def _speculative_line(s: Summary) -> str:
    if not s.speculative:
        return "off (see --speculative)"
    rate = 100 * s.accepted_drafts / max(s.drafted_tokens, 1)
    return (
        f"{s.speculative} drafts per step: {s.speculative_steps} steps verified"
        f" {s.drafted_tokens} drafts, {s.accepted_drafts} accepted ({rate:.0f}%)"
    )


def _prefill_line(s: Summary) -> str:
    total = s.prefill_computed + s.prefill_cached
    saved = 100 * s.prefill_cached / max(total, 1)
    return (
        f"{s.prefill_computed} tokens computed, {s.prefill_cached} read from the cache"
        f" ({saved:.0f}% saved); {s.step_ms:.2f} ms per step"
    )


_EXAMPLE = Summary(
    "cpu", 16, 256, 256, 7000, 5000, 300, 100, 200, 0, 0, 0, 0.0, 0, 1.0, 300.0, 5000.0, 600.0,
    500.0, 0, 20, 3,
    True, "", "pass", True, 1.0,
)  # fmt: skip
