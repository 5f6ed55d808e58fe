"""Seeded `batchstate simulate --json` runs across the engine's capabilities, and their summaries.

Each run is one cell of the capability matrix: the prefix cache on or off,
chunked prefill, mixed steps, overlap, speculative decoding, prebuilt
arrivals, padding to CUDA-graph sizes, page sizes 1 and 16, a KV pool small
enough to retract and evict, shared prefixes and follow-up turns, sampled
rows, and data-parallel ranks; on `meta` (bookkeeping only) and on the CPU
(the tiny model, with the oracle). Only the fields a refactor of the engine
must not move are kept (steps, tokens, cache hits, retractions, chunks,
drafts, padding, the pools left at the end): wall times and per-step
bookkeeping times are left out.

The kept summaries live in `tests/data/engine_summaries.json`;
`tests/engine/test_engine_summaries.py` runs them again and compares. After a
change that is meant to move them, write them afresh and review the diff:

    python tools/engine_summaries.py --write
    python tools/engine_summaries.py            # compare; exit 1 on a difference
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

from batchstate.cli import main

__all__ = ["GOLDEN", "RUNS", "STABLE", "compare", "run_all", "summary_of"]

GOLDEN: Final = Path(__file__).resolve().parent.parent / "tests" / "data" / "engine_summaries.json"

# One process's summary: the fields that depend only on the seeded schedule.
STABLE: Final = (
    "num_requests", "num_finished", "prompt_tokens", "generated_tokens", "steps",
    "extend_steps", "decode_steps", "retractions", "chunks", "mixed_steps",
    "named_reads_per_step", "overshoot_tokens", "device_reads", "audited_steps",
    "invariant_checks", "pools_conserved", "pools", "oracle_passed", "prefill_computed",
    "prefill_cached", "cache_hits", "extended_requests", "evicted_pages", "sampling",
    "prebuilt_requests", "prebuilt_steps", "speculative_steps", "drafted_tokens",
    "accepted_drafts", "padded_rows_per_step", "padded_tokens_per_step", "eager_forwards",
)  # fmt: skip
# A data-parallel run's summary, and each rank's share of it.
STABLE_DP: Final = (
    "num_requests", "num_finished", "generated_tokens", "steps", "waits", "idle_steps",
    "phase_mixes", "oracle_passed", "padded_forwards", "padded_tokens",
)  # fmt: skip
STABLE_RANK: Final = (
    "requests", "busy_steps", "idle_steps", "generated_tokens", "retractions",
    "invariant_checks", "pools_conserved", "pools",
)  # fmt: skip

# A dozen requests with shared prefixes and follow-up turns, all at once, in a pool that
# holds a few at a time: admission runs ahead, decode retracts, the cache evicts.
_PRESSURE: Final = (
    "--requests", "12", "--arrival", "all", "--prompt-len", "4", "20", "--output-len", "8", "16",
    "--shared-prefix", "2", "16", "0.6", "--follow-ups", "0.3", "--seed", "3",
    "--max-running", "12", "--new-token-ratio", "0", "--headroom-pages", "0", "--check-every", "1",
)  # fmt: skip


def _knobs(cache: bool, chunk: int, mixed: bool, overlap: bool, drafts: int) -> list[str]:
    knobs = [] if cache else ["--no-prefix-cache"]
    knobs += ["--chunk-size", str(chunk)] if chunk else []
    knobs += ["--mixed"] if mixed else []
    knobs += [] if overlap else ["--no-overlap"]
    knobs += ["--speculative", str(drafts)] if drafts else []
    return knobs


def _matrix() -> Iterator[tuple[str, list[str]]]:
    # Every combination of the five knobs, at page sizes 1 and 16, on meta.
    for cache, chunk, mixed, overlap, drafts in itertools.product(
        (False, True), (0, 8), (False, True), (False, True), (0, 2)
    ):
        knobs = _knobs(cache, chunk, mixed, overlap, drafts)
        for page_size, kv_tokens in ((1, 96), (16, 128)):
            named = "-".join(knob.lstrip("-") for knob in knobs) or "plain"
            name = f"meta-matrix-{named}-page{page_size}"
            sizes = ["--page-size", str(page_size), "--kv-tokens", str(kv_tokens)]
            yield name, ["--device", "meta", *_PRESSURE, *sizes, *knobs]


def _others() -> Iterator[tuple[str, list[str]]]:
    cpu = ["--device", "cpu", "--requests", "10", "--prompt-len", "4", "24"]
    cpu += ["--output-len", "4", "12", "--seed", "5", "--kv-tokens", "256"]
    yield "cpu-defaults", cpu
    yield "cpu-no-overlap", [*cpu, "--no-overlap"]
    yield "cpu-chunks-mixed", [*cpu, "--chunk-size", "8", "--mixed"]
    yield "cpu-speculative", [*cpu, "--speculative", "3", "--no-overlap"]
    yield "cpu-speculative-overlap", [*cpu, "--speculative", "2", "--chunk-size", "8"]
    yield "cpu-sampled", [*cpu, "--sampling", "mixed", "--chunk-size", "8", "--mixed"]
    yield "cpu-prebuilt", [*cpu, "--prebuilt", "0.5", "--no-overlap"]
    yield "cpu-prebuilt-overlap-chunks", [*cpu, "--prebuilt", "0.5", "--chunk-size", "8"]
    yield "cpu-prebuilt-speculative", [*cpu, "--prebuilt", "0.4", "--speculative", "2"]
    yield "cpu-graphs", [*cpu, "--cuda-graph-sizes", "1", "2", "4", "8", "16", "32"]
    yield "cpu-graphs-no-overlap", [*cpu, "--cuda-graph-sizes", "1", "4", "16", "--no-overlap"]
    yield "cpu-graphs-speculative", [*cpu, "--cuda-graph-sizes", "2", "8", "--speculative", "2"]
    pressure = [*cpu[:-2], "--kv-tokens", "96", "--page-size", "4", "--follow-ups", "0.3"]
    pressure += ["--shared-prefix", "2", "8", "0.5", "--new-token-ratio", "0"]
    yield "cpu-pressure-cache", pressure
    yield "cpu-pressure-no-cache", [*pressure, "--no-prefix-cache", "--no-overlap"]
    yield "cpu-pressure-chunks-spec", [*pressure, "--chunk-size", "4", "--speculative", "2"]
    meta = ["--device", "meta", "--requests", "200", "--seed", "7", "--kv-tokens", "2048"]
    yield "meta-poisson-defaults", meta
    yield "meta-burst-prebuilt", [*meta, "--arrival", "burst", "--prebuilt", "0.3"]
    yield (
        "meta-uniform-shared",
        [*meta, "--arrival", "uniform", "--shared-prefix", "4", "24", "0.7"],
    )
    yield "meta-prefill-cap", [*meta, "--max-prefill-tokens", "64", "--no-overlap"]
    yield (
        "meta-graphs-mixed",
        [*meta, "--cuda-graph-sizes", "8", "32", "--chunk-size", "32", "--mixed"],
    )
    yield (
        "meta-small-pool",
        [*meta[:-2], "--kv-tokens", "256", "--page-size", "8", "--follow-ups", "0.2"],
    )
    dp = ["--device", "cpu", "--requests", "12", "--prompt-len", "4", "16", "--output-len", "4"]
    dp += ["10", "--seed", "2", "--kv-tokens", "128", "--dp", "2"]
    # Each rank is a process of its own (seconds to start): one run with padding and drafts.
    yield "cpu-dp2-graphs-spec", [*dp, "--cuda-graph-sizes", "2", "8", "32", "--speculative", "2"]


RUNS: Final = dict(itertools.chain(_matrix(), _others()))


def summary_of(argv: list[str]) -> dict[str, object]:
    """The stable fields of one `batchstate simulate --json` run, in process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["simulate", *argv, "--json", "-q"])
    full = json.loads(out.getvalue())
    if code != 0:
        raise RuntimeError(f"simulate {' '.join(argv)} exited {code}: {full}")
    if "num_ranks" not in full:
        return {key: full[key] for key in STABLE}
    ranks = [{key: rank[key] for key in STABLE_RANK} for rank in full["ranks"]]
    return {**{key: full[key] for key in STABLE_DP}, "ranks": ranks}


def run_all(names: list[str] | None = None) -> dict[str, dict[str, object]]:
    """The summaries of `names` (every run when None), by name."""
    return {name: summary_of(RUNS[name]) for name in names or RUNS}


def compare(
    got: Mapping[str, Mapping[str, object]], kept: Mapping[str, Mapping[str, object]]
) -> list[str]:
    """One line per field that differs between two sets of summaries (empty: identical)."""
    lines = []
    for name in sorted(got.keys() | kept.keys()):
        new, old = got.get(name), kept.get(name)
        if new is None or old is None:
            lines.append(f"{name}: {'missing now' if new is None else 'not kept'}")
            continue
        lines += [
            f"{name}.{key}: kept {old.get(key)!r}, now {new.get(key)!r}"
            for key in sorted(new.keys() | old.keys())
            if new.get(key) != old.get(key)
        ]
    return lines


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN.name} afresh")
    parser.add_argument("names", nargs="*", help="runs to compare (default: all)")
    args = parser.parse_args()
    got = run_all(args.names or None)
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} summaries to {GOLDEN}")
        return 0
    kept = json.loads(GOLDEN.read_text())
    if args.names:
        kept = {name: kept[name] for name in args.names if name in kept}
    differences = compare(got, kept)
    print("\n".join(differences) or f"{len(got)} summaries identical")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(_main())
