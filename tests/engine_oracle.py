"""What the engine tests share: the tiny model, and each workload's oracle."""

from __future__ import annotations

from functools import cache

from batchstate.engine import (
    END_TOKEN,
    ModelConfig,
    TinyModel,
    WorkloadConfig,
    generate_alone,
    make_model,
    make_workload,
)


@cache
def tiny_model() -> TinyModel:
    """The default tiny model, built once."""
    return make_model(ModelConfig())


@cache
def alone_outputs(workload: WorkloadConfig) -> dict[int, tuple[int, ...]]:
    """Each request of `workload` run alone. It depends on the workload and the model only,
    not on the pools: computed once per workload."""
    return {
        spec.rid: generate_alone(
            tiny_model(), spec.prompt, spec.max_new_tokens, END_TOKEN, spec.sampling
        )
        for spec in make_workload(workload)
    }
