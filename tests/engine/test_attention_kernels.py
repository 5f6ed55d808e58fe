"""The paged and the ragged kernel read the same KV: the forward's contract, held by dedup.

A paged kernel writes a layer's K/V at `out_cache_loc` and then reads every
key through the table; a ragged one (SGLang's FlashInfer ragged path,
FlashAttention's varlen path) attends over the step's own K/V and over the
paged prefix, and writes after. Both are exact only if no cell a row reads
as its prefix is one the forward writes (docs/design.md, "The forward's
contract").

The minimal case: pages of 4, a 13-token prompt admitted as a 6-token chunk,
then a `mix` with a new request carrying the same prompt and one token more
first and the chunk second. The new request computes positions 4 onward;
the chunk, continuing at 6, holds positions 4 and 5 from its first chunk.
Deduplicating the chunk onto the new request's pages would point its
prefix cells 4 and 5 at locations this forward writes, which a ragged
kernel reads before the write. The chunk publishes first instead, and the
new request moves onto its pages at positions it computes itself.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    GREEDY,
    Filtered,
    InvariantViolation,
    Mirrored,
    Pools,
    Req,
    Sampling,
    check_forward,
    check_pools,
    decode,
    finish_mixed,
    idle,
    make_pools,
    mix,
)
from batchstate.engine import (
    EngineConfig,
    ModelConfig,
    ModelTokens,
    SimulationConfig,
    WorkloadConfig,
    generate_alone,
    make_kv_cache,
    make_model,
    simulate,
)
from batchstate.engine._model_config import AttentionKernel

CPU: Final = torch.device("cpu")
PROMPT: Final = (5, 61, 17, 42, 8, 33, 70, 2, 91, 14, 27, 50, 66)  # 13 tokens: pages of 4
NEW: Final = Req(1, (*PROMPT, 9))  # the same prompt and one token more
DECODE_STEPS: Final = 8


def _greedy(count: int) -> Sampling:
    return Sampling.of([GREEDY] * count, CPU)


def _minimal_case(
    attention: AttentionKernel, *, check: bool = False
) -> tuple[dict[int, list[int]], Pools]:
    """Each request's tokens: the one after its prompt, then `DECODE_STEPS` decoded.

    `check`: check each forward's contract before it runs.
    """
    model = make_model(ModelConfig(attention=attention))
    pools = make_pools(4, 32, 64, CPU, page_size=4, prefix_cache=True)
    cache = make_kv_cache(model, pools)
    # Pages hold whatever an earlier owner left: a stale read shows in the tokens.
    generator = torch.Generator().manual_seed(0)
    for part in (cache.k, cache.v):
        part.copy_(torch.randn(part.shape, generator=generator, dtype=part.dtype))
    source = ModelTokens(model, cache)
    first, pools = mix(idle(CPU, Sampling), [Req(0, PROMPT)], 6, pools, (), _greedy(1)).unwrap()
    source.after_mixed(first, pools, None)  # positions 0-5 of request 0
    settled = finish_mixed(first)
    (held,) = settled.held
    second, pools = mix(settled.running, [NEW, held], 64, pools, (), _greedy(1)).unwrap()
    if check:
        check_forward(second, pools)
    sampled = source.read(source.after_mixed(second, pools, None))
    outputs = {int(rid): [token] for rid, token in zip(second.rows.rids, sampled, strict=True)}
    running: Filtered[Sampling] = finish_mixed(second).running
    batch = running
    for _ in range(DECODE_STEPS):
        decoding, pools = decode(batch, pools).unwrap()
        if check:
            check_forward(decoding, pools)
        last = [outputs[int(rid)][-1] for rid in decoding.rows.rids]
        for rid, token in zip(
            decoding.rows.rids, source.after_decode(decoding, pools, last), strict=True
        ):
            outputs[int(rid)].append(token)
        batch = decoding  # type: ignore[assignment]  # decode takes any running record
    check_pools(pools, [batch])
    return outputs, pools


@pytest.mark.parametrize("attention", ["paged", "ragged"])
def test_a_chunk_after_a_new_request_sharing_its_prompt_is_exact(
    attention: AttentionKernel,
) -> None:
    outputs, pools = _minimal_case(attention)
    model = make_model(ModelConfig(attention=attention))
    for rid, prompt in ((0, PROMPT), (1, NEW.input_ids)):
        alone = generate_alone(model, prompt, DECODE_STEPS + 1, end_token=-1)
        assert tuple(outputs[rid]) == alone, (rid, outputs[rid], alone)
    # Held once: one row's copy of positions 4-11 (two pages) was retired.
    assert pools.num_retired == 2


def test_the_minimal_case_keeps_the_contract() -> None:
    """No cell the chunk reads as its prefix is one the forward writes; the kernels agree."""
    paged, _ = _minimal_case("paged", check=True)
    ragged, _ = _minimal_case("ragged", check=True)
    assert paged == ragged


def test_the_contract_names_the_row_and_cell_a_kernel_would_read_stale() -> None:
    """The same forward with the chunk's prefix cells pointed at cells the forward writes."""
    pools = make_pools(4, 32, 64, CPU, page_size=4, prefix_cache=True)
    first, pools = mix(idle(CPU), [Req(0, PROMPT)], 6, pools).unwrap()
    (held,) = finish_mixed(first).held
    second, pools = mix(finish_mixed(first).running, [NEW, held], 64, pools).unwrap()
    new_slot, chunk_slot = second.rows.req_pool_indices.host.tolist()
    # The new request's positions 12 and 13: its own last page, which this forward writes.
    locations = second.out_cache_loc.device[8:10].numpy()
    # NOTE: what deduplicating the chunk below its start would write, written by hand.
    pools.table.write(
        Mirrored.from_ints([chunk_slot, chunk_slot], CPU),
        Mirrored.from_ints([4, 5], CPU),
        Mirrored.from_host(locations.astype(np.int32), CPU),
    )
    with pytest.raises(InvariantViolation) as raised:
        check_forward(second, pools)
    assert str(raised.value).startswith(
        f"check_forward: row 1 (request 0, slot {chunk_slot}) reads position 4 of its prefix"
        f" at location {int(locations[0])}, which this forward writes (row 0 (request 1,"
        f" slot {new_slot}), position 12)"
    )


WORKLOAD: Final = WorkloadConfig(
    num_requests=40,
    arrival="burst",
    burst_size=10,
    prompt_len=(4, 24),
    output_len=(4, 12),
    shared_prefixes=2,
    shared_prefix_len=24,
    shared_fraction=0.8,
    follow_ups=0.3,
)


def test_the_ragged_kernel_runs_the_engine_over_the_prefix_cache_exactly() -> None:
    """Shared prompts in bursts, chunks, mixed steps and overlap: every forward's contract
    checked before it runs (`check_every=1`), the oracle exact."""
    engine = EngineConfig(max_running=16, chunk_size=8, mixed=True, overlap=True)
    config = SimulationConfig(
        workload=WORKLOAD,
        engine=attrs.evolve(engine, check_every=1),
        model=ModelConfig(attention="ragged"),
        num_kv_tokens=256,
        page_size=4,
    )
    run = simulate(config)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.trace.cache_hits > 0
    assert run.trace.num_checks == len(run.trace) + 1
