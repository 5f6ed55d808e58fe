"""A run's memory, estimated from its config before anything is allocated.

Each part is what the engine allocates for it (see `make_pools`,
`make_kv_cache`, `Engine`, `check_oracle`), sized from the options, and
names the option that sizes it most: a run that cannot fit is refused with
that option, not ended by an allocation failure hours in.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import attrs

if TYPE_CHECKING:
    from batchstate.engine._simulate import SimulationConfig

__all__ = [
    "MAX_REQUESTS",
    "PROCESS_BYTES",
    "Footprint",
    "Part",
    "available_memory",
    "estimate",
    "format_bytes",
]

# Each request's prompt and tokens are held until the oracle has checked them;
# above this many, a run is a soak for tools/soak.py, not for the command.
MAX_REQUESTS: Final = 10_000_000
# One more process with torch and the tiny model loaded: 230 MB resident,
# measured with /proc/self/statm on CPython 3.11 and torch 2.13.0 (CPU build).
PROCESS_BYTES: Final = 256 << 20
# Per request: its spec and the engine's and the oracle's entries for it; per
# token of its prompt and output (tuple and list entries); per engine step, the
# trace's six entries. tracemalloc counted 1.3-1.6 KiB per request at the
# default lengths and about 115 B per step; these bound it 2-4x over (checked
# in tests/engine/test_footprint.py), since a request's lengths are taken at their most.
_REQUEST_BYTES: Final = 768
_TOKEN_BYTES: Final = 24
_STEP_BYTES: Final = 160
_INT32, _INT64, _BOOL = 4, 8, 1


@final
@attrs.frozen
class Part:
    """One allocation of a run: what it is, its bytes, and the option that sizes it."""

    what: str
    bytes: int
    option: str
    on_device: bool = False  # on the run's CUDA device, not in host memory


@final
@attrs.frozen
class Footprint:
    """The parts of a run (of every rank, for a data-parallel run)."""

    parts: tuple[Part, ...]

    @property
    def host_bytes(self) -> int:
        return sum(part.bytes for part in self.parts if not part.on_device)

    @property
    def device_bytes(self) -> int:
        return sum(part.bytes for part in self.parts if part.on_device)

    def largest(self, *, on_device: bool) -> Part:
        """The biggest part in host memory (or on the device): the one to make smaller."""
        return max((p for p in self.parts if p.on_device == on_device), key=lambda p: p.bytes)


def estimate(config: SimulationConfig, ranks: int = 1) -> Footprint:
    """What `simulate(config)` holds at its peak, or a `--dp ranks` run: each rank holds it all.

    >>> from batchstate.engine._simulate import SimulationConfig
    >>> big = estimate(SimulationConfig(num_kv_tokens=1 << 30)).largest(on_device=False)
    >>> big.what, format_bytes(big.bytes), big.option
    ('the KV cache', '1.0 TiB', '--kv-tokens')
    """
    workload, engine, model = config.workload, config.engine, config.model
    slots, width = config.num_slots, config.context_len
    pages = config.num_kv_tokens // config.page_size
    runs_model = config.device != "meta"
    on_device = config.device == "cuda"
    slots_option = "--max-running" if config.max_reqs is None else "--max-reqs"
    table = (slots + 1) * width * _INT32
    parts = [
        Part(
            "the request-to-token table",
            table,
            slots_option if slots + 1 >= width else "--max-context-len",
        ),
        # `page_list` and `slot_list` keep a buffer twice their ids, built from an arange.
        Part("the free page list", (pages + 1) * 4 * _INT64, "--kv-tokens"),
        Part("the free slot list", (slots + 1) * 5 * _INT64, slots_option),
    ]
    if model.count("window"):  # the window pages' free list, as the page list's
        window_pages = config.window_tokens // config.page_size + 1
        parts.append(
            Part("the free window page list", window_pages * 4 * _INT64, "--window-tokens")
        )
    if runs_model:  # meta tensors allocate nothing
        parts.append(Part("the table's device side", table, parts[0].option, on_device=on_device))
        itemsize = model.itemsize
        full = model.count("full")
        kv = 2 * full * (pages + 1) * config.page_size * model.d_model * itemsize
        parts.append(Part("the KV cache", kv, "--kv-tokens", on_device=on_device))
        if model.is_hybrid:  # the window layers' K/V and one state per request slot
            window = config.window_tokens + config.page_size
            window_kv = 2 * model.count("window") * window * model.d_model * itemsize
            parts.append(Part("the window K/V", window_kv, "--window-tokens", on_device=on_device))
            states = (config.num_states + 1) * model.state_size * itemsize
            parts.append(Part("the recurrent states", states, slots_option, on_device=on_device))
        parts.append(_forward(config, pages, on_device=on_device))
        if config.oracle or workload.prebuilt:
            parts.append(_alone(config))
    if config.cuda_graph_sizes:
        parts.extend(_buckets(config, on_device=on_device, runs_model=runs_model))
    tokens = workload.longest_prompt + workload.output_len[1]
    rows = max(min(engine.max_running, pages), 1)
    steps = workload.num_requests * (math.ceil(tokens / rows) + 1) + tokens
    held = workload.num_requests * (_REQUEST_BYTES + _TOKEN_BYTES * tokens) + _STEP_BYTES * steps
    parts.append(Part("the requests and their tokens", held, "--requests"))
    if ranks == 1:
        return Footprint(tuple(parts))
    each = [attrs.evolve(part, bytes=part.bytes * ranks) for part in parts]
    return Footprint((*each, Part("the rank processes", PROCESS_BYTES * ranks, "--dp")))


def _forward(config: SimulationConfig, pages: int, *, on_device: bool) -> Part:
    # One layer's attention over the batch, padded to [rows, queries, keys]:
    # scores, their mask and softmax (float), the mask (bool), gathered K and V.
    model, workload = config.model, config.workload
    rows = max(min(config.engine.max_running, pages), 1)
    chunk = config.engine_config.chunk_size
    queries = min(chunk, workload.longest_prompt) if chunk else workload.longest_prompt
    keys = workload.longest_prompt + workload.output_len[1]
    itemsize = model.itemsize
    per_row = queries * keys * (3 * model.num_heads * itemsize + _BOOL) + (
        (queries + 2 * keys) * model.d_model * itemsize
    )
    return Part("one forward's attention", rows * per_row, "--max-running", on_device=on_device)


def _buckets(config: SimulationConfig, *, on_device: bool, runs_model: bool) -> list[Part]:
    # Every bucket a run may allocate (engine/_buckets.py): per captured size t, a decode
    # bucket of t rows and an extend bucket per row count r < t up to --max-running. Each
    # holds its fields (44 r + 8 t + 12 bytes) and r * max_pages int32 cells in its block,
    # a page table and `kv_indices` as large as the cells, `out_cache_loc` and its input
    # ids (int64 [t] each), and host staging bytes as large as its block (on meta, the
    # staging alone is real).
    max_pages = -(-config.context_len // config.page_size)
    device = staging = 0
    for tokens in config.cuda_graph_sizes:
        extend_rows = min(tokens - 1, max(config.engine.max_running, 1))
        rows = tokens + extend_rows * (extend_rows + 1) // 2  # summed over the buckets
        count = 1 + extend_rows
        device += rows * (44 + 12 * max_pages) + count * (24 * tokens + 12)
        staging += rows * (44 + 4 * max_pages) + count * (8 * tokens + 12)
        if config.model.is_hybrid:
            # Its HybridBuffers, and staging as large: window starts, offsets and pages (int32)
            # and new locations (int64 [t]), and state slots (int64).
            hybrid = rows * (16 + 4 * max_pages) + count * (4 + 8 * tokens)
            device += hybrid
            staging += hybrid
    option = "--cuda-graph-sizes"
    parts = [Part("the captured buckets' staging bytes", staging, option)]
    if runs_model:  # meta tensors allocate nothing
        parts.append(Part("the captured buckets' buffers", device, option, on_device=on_device))
    return parts


def _alone(config: SimulationConfig) -> Part:
    # The oracle (and a prefill server) runs a whole prompt alone: [heads, prompt, prompt].
    model, workload = config.model, config.workload
    prompt = workload.longest_prompt
    length = prompt + workload.output_len[1]
    itemsize = model.itemsize
    scores = 3 * model.num_heads * prompt * prompt * itemsize + prompt * prompt * _BOOL
    kv = 4 * model.num_layers * length * model.d_model * itemsize  # its cache, and one copy
    return Part("the oracle, one request alone", scores + kv, "--prompt-len")


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes of host memory a new allocation can take now, or None where it cannot be read.

    Linux's `MemAvailable`; elsewhere the free physical pages `sysconf` reports.
    """
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(count: float) -> str:
    """`count` bytes in binary units, one decimal.

    >>> format_bytes(512), format_bytes(1536), format_bytes(50 * 2**40)
    ('512 B', '1.5 KiB', '50.0 TiB')
    """
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        count /= 1024
        if count < 1024 or unit == "PiB":
            break
    return f"{count:.1f} {unit}"
