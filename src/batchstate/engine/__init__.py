"""A reference continuous-batching engine built only from batchstate's public transitions.

The engine (`Engine`) admits, extends, merges, decodes, retracts, filters
and releases through `batchstate`, in the same stages every step; a
scheduler policy (`SchedulerPolicy`, by default `FirstComeFirstServed`)
decides who goes first and whom decode retracts. A tiny transformer
(`TinyModel`), or with the `hf` extra a Hugging Face transformers
architecture (`build_model`, `ModelConfig.architecture`), reads and
writes a paged KV cache through the batch's metadata and samples each row
with its own parameters (its `Sampling` columns); the oracle
(`check_oracle`) compares every request's tokens with the same model run
alone on a contiguous cache (a transformers model's with transformers'
own `generate`). `simulate` wires them from one config; the
`batchstate simulate` command is its front end. See docs/engine.md.

`launch` runs the same engine on data-parallel ranks over torch.distributed
(`DataParallelConfig`): each rank owns its pools and records, and every rank
takes part in every step. See docs/distributed.md.
"""

# The names below load on first use (PEP 562), as the package's own do: the
# configs (`SimulationConfig`, `WorkloadConfig`, ...) import without torch, so
# the command line checks a run's options before it loads torch.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.engine._admission import Budget, choose, reserve
    from batchstate.engine._build_model import MissingExtra, build_model
    from batchstate.engine._config import EngineConfig, EngineError
    from batchstate.engine._data_parallel import DataParallelRun, RankRun
    from batchstate.engine._dp_config import (
        DataParallelConfig,
        Fault,
        InjectedFault,
        launched_by_torchrun,
    )
    from batchstate.engine._dp_report import render_dp_summary, summarize_dp
    from batchstate.engine._engine import Engine
    from batchstate.engine._feeder import Feeder
    from batchstate.engine._kv_cache import KVCache, make_kv_cache
    from batchstate.engine._language_model import LanguageModel
    from batchstate.engine._launch import RankFailed, launch, run_launched
    from batchstate.engine._model import Attend, TinyModel, make_model
    from batchstate.engine._model_config import (
        ARCHITECTURES,
        ATTENTION_KERNELS,
        HF_INSTALL,
        HYBRID_LAYERS,
        Architecture,
        AttentionKernel,
        ModelConfig,
    )
    from batchstate.engine._oracle import NEAR_TIE, OracleResult, check_oracle, generate_alone
    from batchstate.engine._paged import sample_decode, sample_extend
    from batchstate.engine._plot import check_plot_path, plot_run
    from batchstate.engine._policy import FirstComeFirstServed, SchedulerPolicy
    from batchstate.engine._progress import progress_for
    from batchstate.engine._random_tokens import RandomTokens
    from batchstate.engine._ranks import PeerLost
    from batchstate.engine._report import Summary, render_summary, summarize
    from batchstate.engine._simulate import ProgressCallback, Simulation, simulate
    from batchstate.engine._simulation_config import DEVICES, SimulationConfig
    from batchstate.engine._sources import ModelTokens, TokenSource
    from batchstate.engine._trace import Trace
    from batchstate.engine._verify import Acceptance, UnreadAcceptance
    from batchstate.engine._workload import (
        ARRIVALS,
        END_TOKEN,
        SAMPLING_MIXES,
        Arrival,
        RequestSpec,
        SamplingMix,
        WorkloadConfig,
        make_workload,
    )

__all__ = [
    "ARCHITECTURES",
    "ARRIVALS",
    "ATTENTION_KERNELS",
    "DEVICES",
    "END_TOKEN",
    "HF_INSTALL",
    "HYBRID_LAYERS",
    "NEAR_TIE",
    "SAMPLING_MIXES",
    "Acceptance",
    "Architecture",
    "Arrival",
    "Attend",
    "AttentionKernel",
    "Budget",
    "DataParallelConfig",
    "DataParallelRun",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Fault",
    "Feeder",
    "FirstComeFirstServed",
    "InjectedFault",
    "KVCache",
    "LanguageModel",
    "MissingExtra",
    "ModelConfig",
    "ModelTokens",
    "OracleResult",
    "PeerLost",
    "ProgressCallback",
    "RandomTokens",
    "RankFailed",
    "RankRun",
    "RequestSpec",
    "SamplingMix",
    "SchedulerPolicy",
    "Simulation",
    "SimulationConfig",
    "Summary",
    "TinyModel",
    "TokenSource",
    "Trace",
    "UnreadAcceptance",
    "WorkloadConfig",
    "build_model",
    "check_oracle",
    "check_plot_path",
    "choose",
    "generate_alone",
    "launch",
    "launched_by_torchrun",
    "make_kv_cache",
    "make_model",
    "make_workload",
    "plot_run",
    "progress_for",
    "render_dp_summary",
    "render_summary",
    "reserve",
    "run_launched",
    "sample_decode",
    "sample_extend",
    "simulate",
    "summarize",
    "summarize_dp",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
