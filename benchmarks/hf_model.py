"""The engine on transformers' Llama, on the CPU: `python -m benchmarks.hf_model`.

Runs `simulate` (SGLang's default step: prefix cache, chunks of 32, overlap;
the oracle timed apart) on the `--model llama` size and on a larger Llama,
with the tiny model on the same workload for comparison. Prints, per model,
generated tokens per second of engine wall time, and the share of the
steps' time spent inside batchstate's calls (the bookkeeping) against the
rest (the model's forward, sampling, the engine's own Python), over the steps
not audited (the audit slows the calls it counts); then the oracle's time,
transformers.generate for each request alone. Needs the hf extra.
"""

from __future__ import annotations

import argparse
import os
import platform
from typing import Final

import attrs
import torch

from batchstate.engine import ModelConfig, SimulationConfig, WorkloadConfig, simulate

SMALL: Final = ModelConfig(architecture="llama", dtype="float32", kv_groups=2)  # --model llama
# Four layers of 256 (eight query heads of 32 sharing four K/V heads), a 2,048-token vocabulary.
LARGER: Final = attrs.evolve(
    SMALL, vocab_size=2048, d_model=256, num_layers=4, num_heads=8, d_ff=768
)
TINY: Final = ModelConfig()  # the engine's own float64 toy, for comparison


def measure(model: ModelConfig, requests: int) -> str:
    """One run of `requests` on `model`: a Markdown table row."""
    workload = WorkloadConfig(num_requests=requests, vocab_size=model.vocab_size)
    run = simulate(SimulationConfig(workload=workload, model=model))
    trace = run.trace
    kept = [i for i, audited in enumerate(trace.audited) if not audited]
    step_s = sum(trace.step_s[i] for i in kept)
    booked = sum(trace.bookkeeping_s[i] for i in kept)
    generated = sum(len(tokens) for tokens in run.outputs.values())
    assert run.oracle is not None and run.oracle.passed, run.oracle
    name = model.architecture if model.architecture != "tiny" else "tiny (float64)"
    return (
        f"| {name}, d_model {model.d_model}, {model.num_layers} layers, vocab {model.vocab_size}"
        f" | {requests} | {len(trace)} | {generated} | {generated / run.wall_s:.0f}"
        f" | {1e3 * step_s / len(kept):.2f} | {100 * booked / step_s:.0f}%"
        f" | {100 - 100 * booked / step_s:.0f}% | {run.oracle_s:.1f} s |"
    )


def main() -> None:
    """Print one Markdown row per model, the machine (and its load) first."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `batchstate simulate` runs
    print(
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__},"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| model | requests | steps | generated | tokens/s | ms per step | bookkeeping"
        " | rest (forward) | oracle |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    measure(TINY, 8)  # the process's first run pays the audit's lazy set-up: not timed
    for model in (TINY, SMALL, LARGER):
        print(measure(model, args.requests))


if __name__ == "__main__":
    main()
