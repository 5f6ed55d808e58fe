"""The summary of a data-parallel run: one table (or JSON) for all ranks, printed by rank 0."""

from __future__ import annotations

from typing import final

import attrs

from batchstate.engine._data_parallel import DataParallelRun, RankRun
from batchstate.engine._report import modes_line, run_modes

__all__ = ["DataParallelSummary", "RankSummary", "render_dp_summary", "summarize_dp"]


@final
@attrs.frozen
class RankSummary:
    """One rank's share: requests, steps with and without work, tokens, reads and checks."""

    rank: int
    requests: int
    busy_steps: int
    idle_steps: int  # steps it joined with no rows while another rank had some
    generated_tokens: int
    retractions: int
    device_reads: int | None  # audited decode-path reads; None: no step audited
    invariant_checks: int
    pools_conserved: bool
    pools: str
    bookkeeping_us_per_step: float


@final
@attrs.frozen
class DataParallelSummary:
    """The numbers of one data-parallel run; `ok` as for one process, over every rank."""

    device: str
    backend: str
    num_ranks: int
    num_requests: int
    num_finished: int
    generated_tokens: int
    steps: int  # steps in which some rank had work
    waits: int  # exchanges in which none had (waiting for arrivals, and the last)
    idle_steps: int  # rank-steps joined with no rows
    phase_mixes: dict[str, int]  # e.g. "decode+extend+idle" -> steps whose ranks did just those
    wall_s: float
    steps_per_s: float
    tokens_per_s: float
    ranks: tuple[RankSummary, ...]
    oracle: str
    oracle_passed: bool | None
    oracle_s: float | None
    graph_sizes: tuple[int, ...] = ()  # --cuda-graph-sizes; () pads nothing
    padded_forwards: int = 0  # over every rank
    padded_tokens: int = 0
    # The step's modes, as one process's summary reports them (see `Summary`).
    model: str = "full"
    prefix_cache: bool = False
    chunk_size: int = 0
    mixed: bool = False
    overlap: bool = False
    speculative: int = 0  # draft tokens per step asked for (0: off)

    @property
    def ok(self) -> bool:
        """Every rank's pools conserved, no device read counted, the oracle (if run) passed."""
        return (
            all(rank.pools_conserved and not rank.device_reads for rank in self.ranks)
            and self.num_finished == self.num_requests
            and self.oracle_passed is not False
        )


def summarize_dp(run: DataParallelRun) -> DataParallelSummary:
    """The summary of a finished data-parallel run."""
    ranks = tuple(_rank_summary(rank) for rank in run.ranks)
    generated = sum(rank.generated_tokens for rank in ranks)
    wall = max(run.wall_s, 1e-9)
    return DataParallelSummary(
        device=run.config.device,
        backend=run.dp.backend_on(run.config.device),
        num_ranks=len(ranks),
        num_requests=len(run.specs),
        num_finished=sum(rank.requests for rank in ranks),
        generated_tokens=generated,
        steps=run.steps,
        waits=run.waits,
        idle_steps=sum(rank.idle_steps for rank in ranks),
        phase_mixes=dict(sorted(run.phase_mixes.items())),
        wall_s=run.wall_s,
        steps_per_s=run.steps / wall,
        tokens_per_s=generated / wall,
        ranks=ranks,
        oracle="skipped (--no-oracle)" if run.oracle is None else str(run.oracle),
        oracle_passed=None if run.oracle is None else run.oracle.passed,
        oracle_s=run.oracle_s,
        graph_sizes=run.config.cuda_graph_sizes,
        padded_forwards=sum(rank.padded_forwards for rank in run.ranks),
        padded_tokens=sum(rank.padded_tokens for rank in run.ranks),
        prefix_cache=run.config.prefix_cache,
        speculative=run.config.engine.speculative,
        **run_modes(run.config),
    )


def _rank_summary(rank: RankRun) -> RankSummary:
    return RankSummary(
        rank=rank.rank,
        requests=len(rank.outputs),
        busy_steps=rank.busy_steps,
        idle_steps=rank.idle_steps,
        generated_tokens=sum(len(tokens) for tokens in rank.outputs.values()),
        retractions=rank.retractions,
        device_reads=rank.device_reads,
        invariant_checks=rank.invariant_checks,
        pools_conserved=rank.pools_conserved,
        pools=rank.pools,
        bookkeeping_us_per_step=rank.bookkeeping_us_per_step,
    )


def render_dp_summary(summary: DataParallelSummary) -> str:
    """The summary as a table of the run, then one line per rank."""
    s = summary
    oracle_time = "" if s.oracle_s is None else f"; oracle {s.oracle_s:.2f} s more"
    mixes = ", ".join(f"{mix} {count}" for mix, count in s.phase_mixes.items()) or "none"
    rows = (
        ("ranks", f"{s.num_ranks} on {s.device} ({s.backend})"),
        ("modes", _modes(s)),
        ("requests", f"{s.num_finished} finished / {s.num_requests}"),
        ("steps", f"{s.steps} with work, {s.waits} with none; {s.idle_steps} idle rank-steps"),
        ("phases per step", mixes),
        ("wall time", f"{s.wall_s:.2f} s (engine loop{oracle_time})"),
        ("steps/s", f"{s.steps_per_s:.0f}"),
        ("tokens/s", f"{s.tokens_per_s:.0f} generated"),
        ("cuda graphs", _graphs(s)),
        ("oracle", s.oracle),
    )
    width = max(len(name) for name, _ in rows)
    # The command as run, its option with its value: `--dp` alone would read as a bare option.
    title = f"batchstate simulate --dp {s.num_ranks}"
    lines = [f"{title:<{width}}   {'OK' if s.ok else 'FAILED'}"]
    lines += [f"{name:<{width}}   {value}" for name, value in rows]
    lines.append("")
    lines.append("rank  requests  steps  idle  tokens  retractions  device reads  checks  pools")
    for rank in s.ranks:
        reads = "-" if rank.device_reads is None else str(rank.device_reads)
        pools = ("ok: " if rank.pools_conserved else "LEAK: ") + rank.pools
        lines.append(
            f"{rank.rank:>4}  {rank.requests:>8}  {rank.busy_steps:>5}  {rank.idle_steps:>4}"
            f"  {rank.generated_tokens:>6}  {rank.retractions:>11}  {reads:>12}"
            f"  {rank.invariant_checks:>6}  {pools}"
        )
    return "\n".join(lines)


def _modes(s: DataParallelSummary) -> str:
    # One process's table has a row each for the cache and speculation; this one has no room.
    drafts = f"{s.speculative} drafts per step" if s.speculative else "off"
    return (
        modes_line(s.model, s.chunk_size, mixed=s.mixed, overlap=s.overlap)
        + f", prefix cache {'on' if s.prefix_cache else 'off'}, speculative {drafts}"
    )


def _graphs(s: DataParallelSummary) -> str:
    if not s.graph_sizes:
        return "off: forwards run at their own sizes (see --cuda-graph-sizes)"
    sizes = " ".join(map(str, s.graph_sizes))
    return (
        f"padded to sizes {sizes}, every rank to the bucket of the largest rank's forward:"
        f" {s.padded_forwards} forwards padded, {s.padded_tokens} tokens added"
    )
