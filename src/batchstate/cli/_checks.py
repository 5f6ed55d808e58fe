"""A run's configs, built from the parsed options and checked, all without torch.

The configs are plain values (`batchstate.engine`'s config modules import no
torch), so `SimulationConfig.validate`, the data-parallel layout's checks,
the memory estimate and the `--plot` path are all checked here, before the
run loads torch. A cuda run's checks are the exception: asking whether a
device is there, and how much memory it has free, needs torch (unless the
machine shows no GPU driver at all: then there is no device, said at once).
"""

from __future__ import annotations

import argparse
import os
from typing import Final

import attrs

from batchstate.columns.sampling_params import SamplingParams
from batchstate.engine import (
    HYBRID_LAYERS,
    Architecture,
    AttentionKernel,
    DataParallelConfig,
    EngineConfig,
    Fault,
    ModelConfig,
    SimulationConfig,
    WorkloadConfig,
    check_plot_path,
    footprint,
    launched_by_torchrun,
)

__all__ = ["check_footprint", "checked_run", "cuda_free_bytes"]

_FIXED_OPTIONS: Final = (
    ("temperature", "--temperature"),
    ("top_p", "--top-p"),
    ("top_k", "--top-k"),
    ("min_p", "--min-p"),
)


def checked_run(args: argparse.Namespace) -> tuple[SimulationConfig, DataParallelConfig | None]:
    """The run's configs; `ValueError` or `ImportError` (one line) for a run that cannot go."""
    config = simulation_config(args)
    config.validate()
    dp = data_parallel_config(args)
    if dp is not None:
        dp.validate(config)
    if args.plot is not None:
        if dp is not None:
            raise ValueError("--plot draws one process's run: it does not take --dp")
        check_plot_path(args.plot)
    check_footprint(config, 1 if dp is None else dp.ranks)
    return config, dp


def simulation_config(args: argparse.Namespace) -> SimulationConfig:
    """The options as the engine's configs (not yet checked: see `checked_run`)."""
    count, length, fraction = args.shared_prefix
    workload = WorkloadConfig(
        num_requests=args.requests,
        arrival=args.arrival,
        arrival_rate=args.arrival_rate,
        burst_size=args.burst_size,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
        shared_prefixes=count,
        shared_prefix_len=length,
        shared_fraction=fraction,
        follow_ups=args.follow_ups,
        prebuilt=args.prebuilt,
        sampling=args.sampling,
        fixed_sampling=_fixed_sampling(args),
    )
    engine = EngineConfig(
        max_running=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        new_token_ratio=args.new_token_ratio,
        headroom_pages=args.headroom_pages,
        check_every=args.check_every,
        audit_every=args.audit_every,
        chunk_size=args.chunk_size,
        mixed=args.mixed,
        overlap=args.overlap,
        speculative=args.speculative,
    )
    model = ModelConfig(attention=args.attention)
    if args.model in {"llama", "qwen3"}:
        model = hf_model_config(args.model, args.attention, args.window)
        if args.window is None and args.window_tokens is not None:
            raise ValueError("--window-tokens sizes a sliding-window layer: give --window too")
    elif args.model == "hybrid":
        kinds, window = HYBRID_LAYERS, model.window if args.window is None else args.window
        model = ModelConfig(
            num_layers=len(kinds), layer_kinds=kinds, window=window, attention=args.attention
        )
    else:  # the full-attention model has no window layer they could size
        for option, value in (("--window", args.window), ("--window-tokens", args.window_tokens)):
            if value is not None:
                raise ValueError(f"{option} sizes the window layer of --model hybrid")
    return SimulationConfig(
        workload=workload,
        engine=engine,
        model=model,
        num_window_tokens=args.window_tokens,
        max_reqs=args.max_reqs,
        num_kv_tokens=args.kv_tokens,
        page_size=args.page_size,
        max_context_len=args.max_context_len,
        device=args.device,
        oracle=args.oracle,
        prefix_cache=args.prefix_cache,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes or ()),
    )


def hf_model_config(
    architecture: Architecture, attention: AttentionKernel, window: int | None
) -> ModelConfig:
    """`--model llama` and `qwen3`: two layers of four query heads sharing two K/V heads.

    float32, as such models are run (the tiny model's float64 hides rounding; here the
    oracle allows near-ties, see `engine/_oracle.py`). With `--window N`, the first layer
    attends over its last N positions (Qwen3's sliding-window layer, in window pages).
    """
    model = ModelConfig(
        architecture=architecture, dtype="float32", kv_groups=2, attention=attention
    )
    if window is None:
        return model
    return attrs.evolve(model, layer_kinds=("window", "full"), window=window)


def _fixed_sampling(args: argparse.Namespace) -> SamplingParams:
    # --temperature and the filters set `--sampling fixed`; with another mix they would be ignored.
    given = {name: getattr(args, name) for name, _ in _FIXED_OPTIONS}
    named = [option for name, option in _FIXED_OPTIONS if given[name] is not None]
    if named and args.sampling != "fixed":
        raise ValueError(
            f"{named[0]} sets the parameters of --sampling fixed, not --sampling {args.sampling}"
        )
    changes = {name: value for name, value in given.items() if value is not None}
    return attrs.evolve(WorkloadConfig().fixed_sampling, **changes)


def data_parallel_config(args: argparse.Namespace) -> DataParallelConfig | None:
    """`--dp` and its options as a layout; None for one process."""
    # --dp N spawns N ranks; under torchrun, this process is one of them.
    ranks = args.dp
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if ranks not in (None, world):
            raise ValueError(f"--dp {ranks}, but torchrun started {world} ranks")
        ranks = world
    if ranks is None:
        for option, value in (("--dp-backend", args.dp_backend), ("--dp-fault", args.dp_fault)):
            if value is not None:
                raise ValueError(f"{option} needs --dp")
        return None
    fault = None if args.dp_fault is None else Fault(*args.dp_fault)
    return DataParallelConfig(ranks, args.dp_backend, args.dp_timeout, fault)


def check_footprint(config: SimulationConfig, ranks: int) -> None:
    """Raise `ValueError` (one line, naming the option to lower) for a run that cannot fit."""
    requests = config.workload.num_requests
    if requests > footprint.MAX_REQUESTS:
        raise ValueError(
            f"--requests {requests} is above {footprint.MAX_REQUESTS}, the most one run holds:"
            " lower --requests"
        )
    need = footprint.estimate(config, ranks)
    available = footprint.available_memory()
    if available is not None and need.host_bytes > available:
        part = need.largest(on_device=False)
        raise ValueError(
            f"the run may need {footprint.format_bytes(need.host_bytes)} of memory"
            f" ({part.what}: {footprint.format_bytes(part.bytes)}), more than the"
            f" {footprint.format_bytes(available)} available here: lower {part.option}"
        )
    if need.device_bytes:
        free = cuda_free_bytes()
        each = footprint.estimate(config).device_bytes  # each rank on a device of its own
        if each > free:
            part = need.largest(on_device=True)
            raise ValueError(
                f"the run may need {footprint.format_bytes(each)} of cuda memory ({part.what}),"
                f" more than the {footprint.format_bytes(free)} free: lower {part.option}"
            )


def cuda_free_bytes() -> int:
    """Free memory on the current cuda device (loads torch: only a cuda run asks)."""
    import torch  # noqa: PLC0415

    free, _ = torch.cuda.mem_get_info()
    return free
