"""A data-parallel layout and its planted fault: plain values, checked before torch loads."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, final

import attrs

from batchstate.errors import Error

if TYPE_CHECKING:
    from batchstate.engine._simulation_config import SimulationConfig

__all__ = ["BACKENDS", "DataParallelConfig", "Fault", "InjectedFault", "launched_by_torchrun"]

BACKENDS: Final = ("gloo", "nccl")


class InjectedFault(Error, RuntimeError):
    """The failure a `Fault` plants, to test that every rank stops."""


@final
@attrs.frozen
class Fault:
    """Rank `rank` raises `InjectedFault` in step `step` (counted from 0), after its exchange.

    The other ranks are then in the step's shared layers, waiting for it.
    With `hang`, it stops answering there instead: the others wait until the
    process-group timeout.
    """

    rank: int
    step: int
    hang: bool = False

    def strike(self) -> None:
        """Fail as planned: raise, or with `hang` block forever."""
        if self.hang:
            threading.Event().wait()  # never set: this rank stops answering
        raise InjectedFault(f"injected in step {self.step}")


_TIMEOUT_S: Final = 60.0


@final
@attrs.frozen
class DataParallelConfig:
    """How many ranks, over which backend, and how long a collective may wait."""

    ranks: int
    backend: str | None = None  # None: gloo on the CPU, nccl on CUDA
    timeout_s: float = _TIMEOUT_S  # a collective waiting longer fails every rank
    fault: Fault | None = None

    def backend_on(self, device: str) -> str:
        """The backend of the shared layers' collectives on `device`."""
        if self.backend is not None:
            return self.backend
        return "nccl" if device == "cuda" else "gloo"

    def validate(self, config: SimulationConfig) -> None:
        """Raise `ValueError` with a one-line message for a layout that cannot run.

        >>> from batchstate.engine import SimulationConfig
        >>> DataParallelConfig(0).validate(SimulationConfig())
        Traceback (most recent call last):
        ...
        ValueError: --dp must be >= 1, got 0
        """
        if self.ranks < 1:
            raise ValueError(f"--dp must be >= 1, got {self.ranks}")
        if config.device == "meta":
            raise ValueError("--dp needs a model device (cpu or cuda): meta runs no forward")
        if self.timeout_s <= 0:
            raise ValueError(f"--dp-timeout must be > 0, got {self.timeout_s}")
        backend = self.backend_on(config.device)
        if backend not in BACKENDS:
            raise ValueError(f"unknown --dp-backend {backend!r}: choose one of gloo, nccl")
        if self.fault is not None and not 0 <= self.fault.rank < self.ranks:
            raise ValueError(f"--dp-fault names rank {self.fault.rank}, but --dp is {self.ranks}")
        import torch.distributed  # noqa: PLC0415  (last: the checks of the torch build)

        if not torch.distributed.is_available():
            raise ValueError("--dp: this torch is built without torch.distributed")
        if backend == "nccl" and (
            config.device != "cuda" or not torch.distributed.is_nccl_available()
        ):
            raise ValueError("--dp-backend nccl needs --device cuda and a torch built with NCCL")
        if backend == "gloo" and not torch.distributed.is_gloo_available():
            raise ValueError("--dp-backend gloo is not available in this torch build")


def launched_by_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is one rank of a torchrun launch (its variables are set)."""
    return all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
