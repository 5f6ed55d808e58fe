"""Data-parallel pieces in one process: routing, the exchanged shape, the shared MLP, idle steps."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Final

import pytest
import torch
import torch.distributed as dist

from batchstate import Sampling, idle, make_pools
from batchstate.cli import main
from batchstate.engine import (
    Engine,
    EngineConfig,
    EngineError,
    ModelConfig,
    ModelTokens,
    RequestSpec,
    SimulationConfig,
    WorkloadConfig,
    make_kv_cache,
    make_model,
    make_workload,
)
from batchstate.engine._data_parallel import DataParallelConfig, run_rank
from batchstate.engine._paged import forward_idle
from batchstate.engine._ranks import (
    Fault,
    InjectedFault,
    Phase,
    StepShape,
    join_ranks,
    mlp_slice,
)
from batchstate.engine._router import Router

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

MODEL: Final = ModelConfig()


def _spec(rid: int, arrival: int = 0, follows: int | None = None) -> RequestSpec:
    return RequestSpec(rid, arrival, (1, 2, 3), 4, follows=follows)


def test_router_sends_each_request_to_the_least_loaded_rank_and_counts_it() -> None:
    """Loads grow with each assignment within a step; ties go to the lowest rank."""
    router = Router([_spec(rid) for rid in range(5)], num_ranks=3)
    routed = router.route(0, loads=(2, 0, 1))
    assert [(rank, spec.rid) for rank, spec in routed] == [(1, 0), (1, 1), (2, 2), (0, 3), (1, 4)]
    assert router.done


def test_router_routes_only_what_has_arrived_and_knows_the_next_arrival() -> None:
    router = Router([_spec(0, 0), _spec(1, 5), _spec(2, 9)], num_ranks=2)
    assert [spec.rid for _, spec in router.route(4, loads=(0, 0))] == [0]
    assert router.next_arrival == 5
    assert [spec.rid for _, spec in router.route(9, loads=(0, 0))] == [1, 2]
    assert router.done


def test_a_follow_up_goes_to_its_conversations_rank_whatever_the_loads() -> None:
    router = Router([_spec(0), _spec(1), _spec(2, 3, follows=0)], num_ranks=2)
    first = {spec.rid: rank for rank, spec in router.route(0, loads=(0, 0))}
    ((rank, spec),) = router.route(3, loads=(0, 99) if first[0] == 1 else (99, 0))
    assert (spec.rid, rank) == (2, first[0])


def test_step_shape_travels_as_integers_and_back() -> None:
    shape = StepShape(Phase.MIXED, rows=3, tokens=40, seq_lens_sum=97, busy=True, load=5,
                      finished=2)  # fmt: skip
    assert StepShape.unpacked(shape.packed()) == shape
    assert all(type(value) is int for value in shape.packed())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_mlp_slices_partition_the_hidden_units(world: int) -> None:
    width = MODEL.d_ff
    covered = [
        unit for rank in range(world) for unit in range(width)[mlp_slice(width, rank, world)]
    ]
    assert covered == list(range(width))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_mlp_slices_add_up_to_the_whole_mlp(world: int) -> None:
    """Why ranks may share the MLP by hidden units: the slices' outputs sum to the layer's."""
    model = make_model(MODEL)
    x = torch.randn(
        9, MODEL.d_model, dtype=MODEL.torch_dtype, generator=torch.Generator().manual_seed(1)
    )
    for layer in range(MODEL.num_layers):
        parts = sum(
            model.mlp(layer, x, mlp_slice(MODEL.d_ff, rank, world)) for rank in range(world)
        )
        torch.testing.assert_close(parts, model.mlp(layer, x), rtol=1e-12, atol=1e-12)


def test_an_idle_forward_calls_every_layers_feed_forward_with_no_tokens() -> None:
    """A rank with no rows still reaches each shared layer, from its empty record's mirrors."""
    model = make_model(MODEL)
    calls: list[tuple[int, tuple[int, ...]]] = []

    def feed_forward(layer: int, x: torch.Tensor) -> torch.Tensor:
        calls.append((layer, tuple(x.shape)))
        return model.mlp(layer, x)

    forward_idle(model, idle(torch.device("cpu"), Sampling), feed_forward)
    assert calls == [(layer, (0, MODEL.d_model)) for layer in range(MODEL.num_layers)]


def _engine(specs: list[RequestSpec]) -> Engine:
    pools = make_pools(8, 128, 1024, torch.device("cpu"), 16)
    model = make_model(MODEL)
    return Engine(EngineConfig(), specs, pools, ModelTokens(model, make_kv_cache(model, pools)))


def test_an_idle_step_runs_the_empty_record_and_counts_a_step() -> None:
    engine = _engine([])
    engine.idle_step()
    assert (len(engine.trace), engine.trace.idle_steps, engine.clock) == (1, 1, 1)
    assert not engine.busy


def test_an_idle_step_with_rows_running_is_refused() -> None:
    engine = _engine([RequestSpec(0, 0, (5, 6, 7), 8)])
    engine.arrive()
    engine.step()  # the extend: the row now runs
    assert engine.busy and len(engine.running.rows) == 1
    with pytest.raises(EngineError, match="idle step with 1 rows running"):
        engine.idle_step()


def test_submitted_requests_run_like_those_given_up_front() -> None:
    specs = list(make_workload(WorkloadConfig(num_requests=6, arrival="all")))
    up_front = _engine(specs)
    up_front.run()
    submitted = _engine([])
    for spec in specs:
        submitted.submit(spec)
    submitted.run()
    assert submitted.outputs == up_front.outputs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def one_rank() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_one_rank_runs_the_whole_protocol_and_matches_the_oracle() -> None:
    """A world of one: the exchange, the shared MLP over gloo, routing and the final gather."""
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=12, sampling="mixed"),
        engine=EngineConfig(chunk_size=16, mixed=True),
        num_kv_tokens=512,
    )
    group = join_ranks(0, 1, "gloo", torch.device("cpu"),
                       init_method=f"tcp://127.0.0.1:{_free_port()}", timeout_s=30)  # fmt: skip
    heard: list[tuple[str, int, int]] = []
    run = run_rank(group, config, DataParallelConfig(1), lambda *report: heard.append(report))
    assert run is not None and run.oracle is not None
    assert run.oracle.passed, run.oracle
    (rank,) = run.ranks
    assert len(run.outputs) == 12 and rank.pools_conserved
    assert rank.busy_steps == run.steps and rank.idle_steps == 0
    assert set(run.phase_mixes) <= {"mixed", "idle"} and "mixed" in run.phase_mixes
    assert heard[-1] == ("oracle", 12, 12)
    assert ("engine", 12, 12) in heard


@pytest.mark.usefixtures("one_rank")
def test_a_planted_fault_strikes_in_its_step_after_the_exchange() -> None:
    group = join_ranks(0, 1, "gloo", torch.device("cpu"),
                       init_method=f"tcp://127.0.0.1:{_free_port()}", timeout_s=30)  # fmt: skip
    config = SimulationConfig(workload=WorkloadConfig(num_requests=4, arrival="all"))
    with pytest.raises(InjectedFault, match="injected in step 2"):
        run_rank(group, config, DataParallelConfig(1, fault=Fault(0, 2)), lambda *_: None)
    assert len(group.shapes) == 1  # the step's shapes were exchanged before it struck


def test_the_layout_is_checked_before_anything_starts() -> None:
    good = SimulationConfig()
    for dp, message in (
        (DataParallelConfig(0), "--dp must be >= 1, got 0"),
        (DataParallelConfig(-2), "--dp must be >= 1, got -2"),
        (DataParallelConfig(2, backend="nccl"), "--dp-backend nccl needs --device cuda"),
        (DataParallelConfig(2, backend="mpi"), "unknown --dp-backend 'mpi'"),
        (DataParallelConfig(2, timeout_s=0), "--dp-timeout must be > 0"),
        (DataParallelConfig(2, fault=Fault(2, 0)), "--dp-fault names rank 2, but --dp is 2"),
    ):
        with pytest.raises(ValueError, match=message):
            dp.validate(good)
    with pytest.raises(ValueError, match="meta runs no forward"):
        DataParallelConfig(2).validate(SimulationConfig(device="meta"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dp", "0"], "--dp must be >= 1, got 0"),
        (["--dp", "-3"], "--dp must be >= 1, got -3"),
        (["--dp", "2", "--dp-backend", "nccl"], "--dp-backend nccl needs --device cuda"),
        (["--dp", "2", "--device", "meta"], "meta runs no forward"),
        (["--dp", "2", "--dp-timeout", "0"], "--dp-timeout must be > 0"),
        (["--dp", "2", "--dp-fault", "5:1"], "--dp-fault names rank 5, but --dp is 2"),
        (["--dp-fault", "1:3"], "--dp-fault needs --dp"),
        (["--dp-backend", "gloo"], "--dp-backend needs --dp"),
        (["--dp", "2", "--dp-fault", "one"], "expected RANK:STEP or RANK:STEP:hang, got 'one'"),
        (["--dp", "2", "--dp-fault", "1:2:stop"], "got '1:2:stop'"),
        (["--dp", "2", "--plot", "run.png"], "--plot draws one process's run"),
    ],
)
def test_a_layout_that_cannot_run_is_a_one_line_usage_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any rank starts: exit status 2, one line, no traceback."""
    assert main(["simulate", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
