"""Everything a run needs: a plain value, built and checked without importing torch.

The command line checks a run's options through `SimulationConfig.validate`
before it loads torch and the engine, so that a usage error is immediate.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import attrs

from batchstate.captured.sizes import PaddingError, check_sizes
from batchstate.engine._config import EngineConfig
from batchstate.engine._model_config import (
    ARCHITECTURES,
    ATTENTION_KERNELS,
    HF_INSTALL,
    ModelConfig,
)
from batchstate.engine._workload import WorkloadConfig

if TYPE_CHECKING:
    import torch

    from batchstate import Pools

__all__ = ["DEVICES", "SimulationConfig", "gpu_driver_present"]

DEVICES = ("cpu", "meta", "cuda")
NO_CUDA: Final = "device cuda: no CUDA device is available here"
GPU_DRIVER_FILES: Final = ("/proc/driver/nvidia/version", "/dev/kfd", "/dev/dxg")
GPU_DRIVER_TOOLS: Final = ("nvidia-smi",)


@final
@attrs.frozen
class SimulationConfig:
    """Everything a run needs. `None` sizes follow the workload (see `validate`)."""

    workload: WorkloadConfig = attrs.field(factory=WorkloadConfig)
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    max_reqs: int | None = None  # request slots; default: engine.max_running
    num_kv_tokens: int = 2048
    page_size: int = 16
    max_context_len: int | None = None  # default: longest prompt + longest output
    device: str = "cpu"
    oracle: bool = True  # ignored on meta, which runs no model
    prefix_cache: bool = True  # share KV of common prefixes, when the workload has any
    # Captured CUDA-graph sizes (tokens; rows for decode): every forward is padded to the
    # next one, on every device; () pads nothing.
    cuda_graph_sizes: tuple[int, ...] = ()
    # A hybrid model's window token slots (whole pages); None: room for every request
    # slot's window. Full-attention models keep none.
    num_window_tokens: int | None = None

    @property
    def window_tokens(self) -> int:
        """The window token slots of a hybrid model's window layers (0: it has none)."""
        if not self.model.count("window"):
            return 0
        if self.num_window_tokens is not None:
            return self.num_window_tokens
        one_row = (-(-self.model.window // self.page_size) + 1) * self.page_size
        longest = -(-self.workload.longest_prompt // self.page_size) * self.page_size
        # With the prefix cache, as much again for the anchors' window tails.
        rows = self.num_slots * (2 if self.prefix_cache else 1)
        return max(rows * one_row, longest + self.page_size)

    @property
    def num_states(self) -> int:
        """A hybrid model's state slots: one per request slot, and one per anchor with the cache."""
        return self.num_slots * (2 if self.prefix_cache else 1) if self.model.count("state") else 0

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's settings for this run."""
        return self.engine

    @property
    def num_slots(self) -> int:
        return self.engine.max_running if self.max_reqs is None else self.max_reqs

    @property
    def context_len(self) -> int:
        longest = self.workload.longest_prompt + self.workload.output_len[1]
        return longest if self.max_context_len is None else self.max_context_len

    def make_pools(self, device: torch.device) -> Pools:
        """Empty pools of this run's sizes on `device`, with the prefix cache on or off."""
        from batchstate import (  # noqa: PLC0415  (a config loads no torch)
            MemoryKinds,
            RecurrentState,
            SlidingWindow,
            make_pools,
        )

        model = self.model
        kinds: list[SlidingWindow | RecurrentState] = []
        if model.count("window"):
            kinds.append(SlidingWindow(model.window, self.window_tokens))
        if model.count("state"):
            kinds.append(RecurrentState(model.state_size, self.num_states))
        return make_pools(
            self.num_slots,
            self.context_len,
            self.num_kv_tokens,
            device,
            self.page_size,
            prefix_cache=self.prefix_cache,
            memory=MemoryKinds(tuple(kinds)),
        )

    def validate(self) -> None:
        """Raise `ValueError` with a one-line message for a run that cannot work.

        That includes values past what the run can hold: `engine.max_running` above the KV
        pool's tokens (each running request holds one), `engine.speculative` drafts that,
        with the decode token, would not fit in a table row or the KV pool.

        >>> SimulationConfig(num_kv_tokens=64).validate()
        Traceback (most recent call last):
        ...
        ValueError: the KV pool is too small for one request: ...
        """
        self.workload.validate()
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}: choose one of {', '.join(DEVICES)}")
        engine = self.engine
        for name, value in (
            ("--max-running", engine.max_running),
            ("--max-reqs", self.num_slots),
            ("--page-size", self.page_size),
            ("--max-prefill-tokens", engine.max_prefill_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_slots < engine.max_running:
            raise ValueError(
                f"--max-reqs {self.num_slots} is below --max-running {engine.max_running}:"
                " every running request holds a request slot"
            )
        if engine.new_token_ratio < 0:
            raise ValueError(f"--new-token-ratio must be >= 0, got {engine.new_token_ratio}")
        for name, value in (
            ("--headroom-pages", engine.headroom_pages),
            ("--check-every", engine.check_every),
            ("--audit-every", engine.audit_every),
            ("--chunk-size", engine.chunk_size),
            ("--speculative", engine.speculative),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.num_kv_tokens < 0 or self.num_kv_tokens % self.page_size:
            raise ValueError(
                f"--kv-tokens must be a non-negative multiple of --page-size={self.page_size},"
                f" got {self.num_kv_tokens}"
            )
        # A request needs its whole prompt and output in KV at once (whole pages).
        longest = self.workload.longest_prompt + self.workload.output_len[1]
        pages = -(-longest // self.page_size)
        if pages * self.page_size > self.num_kv_tokens:
            raise ValueError(
                f"the KV pool is too small for one request: the longest needs {longest} tokens"
                f" ({pages} pages of {self.page_size}), --kv-tokens is {self.num_kv_tokens}"
            )
        if longest > self.context_len:
            raise ValueError(
                f"--max-context-len {self.context_len} is shorter than the longest request"
                f" ({longest} tokens)"
            )
        self._check_bounds()
        self._check_model()
        _check_graph_sizes(self.cuda_graph_sizes)
        self._check_hybrid()
        if self.device == "cuda":  # last: the one check that loads torch
            _check_cuda()

    def _check_bounds(self) -> None:
        # Values no run can hold, each bounded by the options it follows from: above them a
        # run would only allocate for nothing (slots) or draft for nothing (drafts).
        engine = self.engine
        if engine.max_running > self.num_kv_tokens:
            raise ValueError(
                f"--max-running {engine.max_running} is above {self.num_kv_tokens}, the tokens"
                " in the KV pool (--kv-tokens), and each running request holds one at least:"
                " lower --max-running"
            )
        # A verify window holds a row's decode token and its drafts: in its table row, and in
        # the KV pool (which may be narrower than a --max-context-len given by hand).
        room, holder = min(
            (self.context_len, "a request's table row (--max-context-len)"),
            (self.num_kv_tokens, "the KV pool (--kv-tokens)"),
        )
        if engine.speculative >= room:
            raise ValueError(
                f"--speculative {engine.speculative} is above {room - 1}: a verify window holds"
                f" a row's decode token and its drafts, and {holder} holds {room} tokens:"
                " lower --speculative"
            )

    def _check_model(self) -> None:
        if self.model.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"unknown attention kernel {self.model.attention!r}: choose one of"
                f" {', '.join(ATTENTION_KERNELS)}"
            )
        if self.workload.vocab_size != self.model.vocab_size:
            raise ValueError("the workload and the model must share a vocabulary size")
        self._check_architecture()

    def _check_architecture(self) -> None:
        model = self.model
        if model.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {model.architecture!r}: choose one of"
                f" {', '.join(ARCHITECTURES)}"
            )
        if model.kv_groups < 1 or model.num_heads % model.kv_groups:
            raise ValueError(f"{model.num_heads} heads do not split into {model.kv_groups} groups")
        if model.architecture == "tiny":
            if model.kv_groups != 1:
                raise ValueError("the tiny model has one K/V head per query head (kv_groups 1)")
            return
        if model.count("state"):
            raise ValueError(f"--model {model.architecture} has no recurrent-state layer")
        if model.count("window") and model.architecture != "qwen3":
            raise ValueError("--window: sliding-window layers are Qwen3's (its layer_types)")
        # The one check that looks for the optional extra (without importing it).
        if self.device != "meta" and importlib.util.find_spec("transformers") is None:
            raise ValueError(
                f"--model {model.architecture} runs Hugging Face transformers, which is not"
                f" installed: {HF_INSTALL}"
            )

    def _check_hybrid(self) -> None:
        # What hybrid pools refuse, or what the engine cannot yet do for them, as usage errors.
        model = self.model
        if not model.is_hybrid:
            return
        if not 1 <= model.window <= self.context_len:
            raise ValueError(
                f"--window {model.window} must be in [1, {self.context_len}], the context"
            )
        # A forward holds the window pages of every position it queries and the window before
        # them: a whole prompt's, a chunk's, or a verify window's (a page more where it straddles).
        longest, chunk = self.workload.longest_prompt, self.engine.chunk_size
        piece = min(longest, chunk + model.window - 1) if chunk else longest
        piece = max(piece, model.window + self.engine.speculative)
        one_row = (-(-piece // self.page_size) + 1) * self.page_size
        tokens = self.window_tokens
        if model.count("window") and (tokens % self.page_size or tokens < one_row):
            raise ValueError(
                f"--window-tokens {tokens} must be whole pages of {self.page_size}, at least"
                f" {one_row}: the window pages one request's longest forward holds"
            )


def _check_graph_sizes(sizes: tuple[int, ...]) -> None:
    if sizes:
        try:
            check_sizes(sizes)
        except PaddingError as error:
            raise ValueError(f"--cuda-graph-sizes: {error}") from None


def _check_cuda() -> None:
    # Importing torch takes seconds; on a machine with no GPU driver there is nothing to ask it.
    if not gpu_driver_present():
        raise ValueError(NO_CUDA)
    import torch  # noqa: PLC0415  (only a cuda run's check loads it)

    if not torch.cuda.is_available():
        raise ValueError(NO_CUDA)


def gpu_driver_present() -> bool:
    """Whether this machine shows a GPU driver torch's cuda could use, asked without torch.

    NVIDIA's kernel module (its `/proc` entry, which containers see too) or its
    `nvidia-smi` on PATH (Windows), ROCm's `/dev/kfd` (ROCm builds of torch answer
    as cuda), WSL's `/dev/dxg`. False means torch would find no device either;
    True leaves the answer to `torch.cuda.is_available()`.
    """
    return any(Path(path).exists() for path in GPU_DRIVER_FILES) or any(
        shutil.which(tool) for tool in GPU_DRIVER_TOOLS
    )
