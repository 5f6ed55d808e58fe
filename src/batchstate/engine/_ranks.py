"""Data-parallel ranks over torch.distributed: the step-shape exchange and the shared MLP.

Each rank runs attention over its own rows; the MLP of every layer is shared
by all ranks, as in engines with data-parallel attention. Every step, the
ranks first exchange their batch shapes, built from host mirrors, on a CPU
(gloo) group: that one collective tells each rank how many tokens every
other rank brings to the shared layers, so no device value is ever read to
size a collective. Then each layer gathers every rank's tokens on the device
group, each rank computes its slice of the MLP's hidden units over all of
them, the slices are summed, and each rank keeps its own tokens.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Callable, Sequence
from typing import Final, final

import attrs
import numpy as np
import torch
import torch.distributed as dist

from batchstate.engine._dp_config import BACKENDS, Fault, InjectedFault
from batchstate.engine._engine import EngineError
from batchstate.engine._language_model import LanguageModel
from batchstate.errors import Error

__all__ = [
    "BACKENDS",
    "Fault",
    "InjectedFault",
    "PeerLost",
    "Phase",
    "RankGroup",
    "StepShape",
    "join_ranks",
    "mlp_slice",
]


class PeerLost(Error, RuntimeError):
    """A collective failed: another rank stopped (it raised, died or timed out)."""


class Phase(enum.IntEnum):
    """What a rank's batch does in a step, as exchanged between ranks."""

    IDLE = 0  # no rows: joins the shared layers with no tokens
    EXTEND = 1
    DECODE = 2
    MIXED = 3  # prompt chunks and decode rows in one forward
    PREBUILT = 4  # rows whose KV arrived from a prefill server: no forward of their own
    VERIFY = 5  # speculative decoding: each row's decode token and its drafts


@final
@attrs.frozen
class StepShape:
    """One rank's batch this step, from its host mirrors, and what it holds.

    `tokens` is what the rank brings to the shared layers; `busy`, `load` and
    `finished` let every rank apply the same routing and stopping rules.
    """

    phase: Phase
    rows: int
    tokens: int
    seq_lens_sum: int  # the batch's KV length, from the seq_lens mirror
    busy: bool  # the rank has work: it stepped a batch, not just an empty record
    load: int  # requests the rank holds (queued, held, running)
    finished: int  # requests the rank has finished so far

    def packed(self) -> list[int]:
        return [int(self.phase), self.rows, self.tokens, self.seq_lens_sum, int(self.busy),
                self.load, self.finished]  # fmt: skip

    @classmethod
    def unpacked(cls, values: Sequence[int]) -> StepShape:
        phase, rows, tokens, seq_lens_sum, busy, load, finished = values
        return cls(Phase(phase), rows, tokens, seq_lens_sum, bool(busy), load, finished)


_FIELDS: Final = len(attrs.fields(StepShape))


@final
class RankGroup:
    """This process's place among the ranks, and the collectives of a step.

    Build it with `join_ranks`. Every rank must call `exchange` once per step
    and then `shared_mlp` once per layer of that step's forward (or not at
    all when no rank has a token), in the same order on every rank.
    """

    def __init__(self, rank: int, world: int, device: torch.device, cpu: dist.ProcessGroup,
                 shared: dist.ProcessGroup) -> None:  # fmt: skip
        self.rank, self.world, self.device = rank, world, device
        self._cpu, self._shared = cpu, shared
        self.shapes: tuple[StepShape, ...] = ()  # every rank's shape, this step
        self.padded_to = 0  # this step's captured size every padding rank brings; 0: none

    def exchange(self, shape: StepShape) -> tuple[StepShape, ...]:
        """Every rank's shape this step, in rank order: one all-gather of host integers."""
        mine = torch.tensor(shape.packed(), dtype=torch.int64)
        everyone = [torch.empty(_FIELDS, dtype=torch.int64) for _ in range(self.world)]
        _collective(lambda: dist.all_gather(everyone, mine, group=self._cpu))
        self.shapes = tuple(StepShape.unpacked(values.tolist()) for values in everyone)
        return self.shapes

    @property
    def tokens(self) -> tuple[int, ...]:
        """Tokens each rank brings to this step's shared layers (padded, when ranks pad)."""
        size = self.padded_to
        if not size:
            return tuple(shape.tokens for shape in self.shapes)
        # Every rank pads to the step's size but a verify window, which runs eagerly.
        return tuple(shape.tokens if shape.phase is Phase.VERIFY else size for shape in self.shapes)

    def pad_to(self, sizes: Sequence[int]) -> int:
        """Set and return the captured size every rank pads this step to: the smallest that
        holds the largest rank's forward (0: no sizes, or a forward larger than every size,
        which every rank then runs eagerly). The same on every rank: it reads the exchange."""
        largest = max(
            (shape.tokens for shape in self.shapes if shape.phase is not Phase.VERIFY), default=0
        )
        fits = [size for size in sizes if size >= largest]
        self.padded_to = min(fits) if sizes and largest and fits else 0
        return self.padded_to

    def shared_mlp(self, model: LanguageModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s MLP over every rank's tokens; this rank's rows of the result.

        Gathers `x` from every rank (padded to the longest, sizes from the
        exchange), computes this rank's slice of the hidden units over all
        tokens, sums the slices across ranks, and returns this rank's tokens.
        """
        counts = self.tokens
        if x.shape[0] != counts[self.rank]:
            raise EngineError(
                f"rank {self.rank} brings {x.shape[0]} tokens to the shared layer,"
                f" but exchanged {counts[self.rank]}"
            )
        padded = x.new_zeros(max(counts), x.shape[1])
        padded[: x.shape[0]] = x
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        _collective(lambda: dist.all_gather(gathered, padded, group=self._shared))
        everyone = torch.cat([part[:count] for part, count in zip(gathered, counts, strict=True)])
        out = model.mlp(layer, everyone, mlp_slice(model.config.d_ff, self.rank, self.world))
        _collective(lambda: dist.all_reduce(out, group=self._shared))
        start = sum(counts[: self.rank])
        return out[start : start + x.shape[0]]

    def gather_results(self, result: object) -> list[object] | None:
        """Every rank's `result` on rank 0, in rank order; None on the other ranks."""
        results: list[object] | None = [None] * self.world if self.rank == 0 else None
        _collective(lambda: dist.gather_object(result, results, dst=0, group=self._cpu))
        return results

    def leave(self) -> None:
        """Leave the process group, together: every rank waits for the others, then tears down."""
        _collective(lambda: dist.barrier(group=self._cpu))
        dist.destroy_process_group()


def mlp_slice(width: int, rank: int, world: int) -> slice:
    """The MLP hidden units rank `rank` of `world` computes: near-equal, disjoint, covering all.

    >>> [mlp_slice(10, rank, 3) for rank in range(3)]
    [slice(0, 3, None), slice(3, 7, None), slice(7, 10, None)]
    """
    bounds = np.linspace(0, width, world + 1).round().astype(int)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def join_ranks(
    rank: int, world: int, backend: str, device: torch.device, *, init_method: str, timeout_s: float
) -> RankGroup:
    """Join the process group (every rank calls this) and build this rank's `RankGroup`.

    `backend` carries the shared layers' tensors (gloo on the CPU, nccl on
    CUDA); the step shapes always travel on a gloo group of host tensors.
    A collective that waits longer than `timeout_s` fails with `PeerLost`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
    )
    cpu = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    world_group = dist.group.WORLD
    assert world_group is not None
    return RankGroup(rank, world, device, cpu or world_group, world_group)


def _collective(call: Callable[[], object]) -> None:
    try:
        call()
    except RuntimeError as error:  # gloo and nccl raise RuntimeError (DistBackendError)
        raise PeerLost(f"a collective failed, another rank stopped: {error}") from error
