"""The options of a run's workload, sampling, engine and pools (argparse groups)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Final, TypeAlias

from batchstate.cli._values import SharedPrefix, Switch

__all__ = [
    "ARRIVALS",
    "ATTENTION_KERNELS",
    "DEVICES",
    "MODELS",
    "SAMPLING_MIXES",
    "Add",
    "add_engine_options",
    "add_sampling_options",
    "add_workload_options",
]

Add: TypeAlias = Callable[..., argparse.Action]  # an argument group's add_argument
# The choices of the engine's options, written here so that `--help` imports no
# engine module; tests/cli/test_light_imports.py checks they are the engine's own.
ARRIVALS: Final = ("all", "uniform", "poisson", "burst")
SAMPLING_MIXES: Final = ("greedy", "mixed", "fixed")
DEVICES: Final = ("cpu", "meta", "cuda")
MODELS: Final = ("full", "hybrid", "llama", "qwen3")
ATTENTION_KERNELS: Final = ("paged", "ragged")


def add_workload_options(add: Add) -> None:
    add("--requests", type=int, default=256, metavar="N", help="requests in the workload")
    add("--arrival", choices=ARRIVALS, default="poisson", help="how requests arrive over steps")
    add("--arrival-rate", type=float, default=2.0, metavar="R", help="requests per engine step")
    add(
        "--burst-size",
        type=int,
        default=32,
        metavar="N",
        help="requests per burst, for --arrival burst",
    )
    add(
        "--prompt-len",
        type=int,
        nargs=2,
        default=[8, 48],
        metavar=("MIN", "MAX"),
        help="prompt tokens, drawn uniformly from MIN..MAX (default: 8 48)",
    )
    add(
        "--output-len",
        type=int,
        nargs=2,
        default=[4, 48],
        metavar=("MIN", "MAX"),
        help="most tokens to generate, drawn from MIN..MAX; the end token stops one early"
        " (default: 4 48)",
    )
    add("--seed", type=int, default=0, help="seed of the workload and of meta's tokens")
    add(
        "--shared-prefix",
        action=SharedPrefix,
        nargs=3,
        default=(0, 32, 0.0),
        metavar=("COUNT", "LEN", "FRACTION"),
        help="COUNT distinct prefixes of LEN tokens; a FRACTION of the requests start with one"
        " (default: 0 32 0.0, none)",
    )
    add(
        "--follow-ups",
        type=float,
        default=0.0,
        metavar="F",
        help="share of requests that are a second turn of an earlier one: its prompt and"
        " answer, then new tokens",
    )
    add(
        "--prebuilt",
        type=float,
        default=0.0,
        metavar="F",
        help="share of first turns prefilled elsewhere (disaggregated prefill): they arrive"
        " with their prompt's KV and first token (--model hybrid: a window layer's tail and"
        " the recurrent state too), and this engine decodes them",
    )


def add_sampling_options(add: Add) -> None:
    add(
        "--sampling",
        choices=SAMPLING_MIXES,
        default="greedy",
        help="how requests sample: greedy (the most likely token); mixed (each request draws"
        " its own: a quarter greedy, the rest a temperature of 0.6-1.2 with or without top-k,"
        " top-p and min-p); fixed (every request as --temperature, --top-p, --top-k, --min-p)."
        " Each sampled request has its own seed",
    )
    add(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="--sampling fixed: logits are divided by T; 0 is greedy (default: 1.0)",
    )
    add(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="--sampling fixed: keep the most likely tokens whose probability reaches P"
        " (default: 1.0, all)",
    )
    add(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="--sampling fixed: keep the K most likely tokens; 0 keeps all (default: 0)",
    )
    add(
        "--min-p",
        type=float,
        default=None,
        metavar="P",
        help="--sampling fixed: drop tokens less likely than P times the most likely"
        " (default: 0.0)",
    )


def add_engine_options(add: Add) -> None:
    add(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu or cuda run the tiny model and the oracle; meta runs the bookkeeping only",
    )
    add(
        "--model",
        choices=MODELS,
        default="full",
        help="full: every layer attends over all earlier tokens; hybrid: a sliding-window"
        " layer (its own window pages, given back as rows grow), a recurrent-state layer (a"
        " state slot per request) and a full-attention layer. With the prefix cache, rows"
        " resume from cached window tails and states. llama, qwen3: Hugging Face"
        " transformers' architecture (Qwen3: RMSNorm on each head's queries and keys), small"
        " and seeded, grouped-query attention over the engine's paged cache, checked against"
        " transformers' generate (needs the hf extra: pip install 'batchstate[hf]')",
    )
    add(
        "--attention",
        choices=ATTENTION_KERNELS,
        default="paged",
        help="the full-attention layers' kernel. paged: write the step's K/V into the cache,"
        " then read every key through the table; ragged: attend over the step's own K/V and"
        " over the paged prefix, merge, then write (SGLang's FlashInfer ragged path): it"
        " reads the prefix before the write",
    )
    add(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="--model hybrid: positions a window layer reads, itself included (default: 32);"
        " --model qwen3: make its first layer a sliding-window layer of N positions",
    )
    add(
        "--window-tokens",
        type=int,
        default=None,
        metavar="N",
        help="--model hybrid, or qwen3 with --window: window token slots, whole pages"
        " (default: one window, plus a"
        " page, per request slot, twice that with the prefix cache for its window tails)",
    )
    add("--max-running", type=int, default=32, metavar="N", help="requests running at once")
    add(
        "--max-reqs",
        type=int,
        default=None,
        metavar="N",
        help="request slots in the pools, at least --max-running (default: --max-running)",
    )
    add("--kv-tokens", type=int, default=1024, metavar="N", help="KV cache tokens in the pool")
    add("--page-size", type=int, default=16, metavar="N", help="KV tokens per page")
    add(
        "--max-context-len",
        type=int,
        default=None,
        metavar="N",
        help="width of the request-to-token table (default: longest prompt + longest output)",
    )
    add("--max-prefill-tokens", type=int, default=1024, metavar="N", help="input ids per extend")
    add(
        "--new-token-ratio",
        type=float,
        default=0.3,
        metavar="R",
        help="share of a request's output budget reserved when it is admitted",
    )
    add("--headroom-pages", type=int, default=1, metavar="N", help="pages reserved per admission")
    add(
        "--prefix-cache",
        action=Switch,
        default=True,
        help="cache finished requests' KV for later prefixes (on by default; off: give it back)",
    )
    add(
        "--chunk-size",
        type=int,
        default=32,
        metavar="N",
        help="prompt tokens per step; longer prompts are prefilled in chunks; 0: whole prompts",
    )
    add(
        "--mixed",
        action=Switch,
        default=False,
        help="run prompt chunks beside the running decode rows, in one forward (off by"
        " default: a step with chunks is a prefill step of its own, as in SGLang)",
    )
    add(
        "--overlap",
        action=Switch,
        default=True,
        help="keep each step's sampled tokens on the device and check finishes one step late"
        " (on by default; off: read them before building the next step)",
    )
    add(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per decode step with a draft model (the target's first layer) and"
        " verify them with the target; 0: no speculation. With overlap, the next verify window"
        " opens before the last one's accepted tokens are read (one read a step)",
    )
    add(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="captured CUDA-graph sizes, increasing: every forward is padded to the next one"
        " (tokens; rows for decode), on the CPU too; larger forwards run unpadded"
        " (default: none, no padding)",
    )
