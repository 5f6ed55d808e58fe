"""What mypy must reject and accept: illegal transitions, half mirrors, frozen fields.

All snippets go through one mypy run (the project's strict configuration and
the returns and batchstate plugins); each test then reads its snippet's errors.
"""

from __future__ import annotations

import functools
import textwrap
from typing import Final

import pytest

from batchstate import TRANSITIONS, Decoding, Extended, Filtered, Idle, merge
from tests.typecheck import mypy_errors

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

_PRELUDE: Final = """\
import attrs
import numpy as np
import numpy.typing as npt
import torch
from batchstate import *
from batchstate.captured import *
from batchstate.checks import *
from batchstate.columns import *
from batchstate.errors import *
from batchstate.forward import *
from batchstate.memory import *
from batchstate.records import *
from batchstate.speculative import *
from batchstate.transitions import *

@attrs.frozen(eq=False)
class Lora(Columns):
    adapter: Mirrored[np.int32]

def snippet(
    idle_: Idle, extended: Extended, decoding: Decoding, filtered: Filtered,
    pools: Pools, reqs: list[Req], tensor: torch.Tensor, pair: Mirrored, device_only: DeviceOnly,
    with_sampling: Decoding[Sampling], sampling_idle: Idle[Sampling], lora: Filtered[Lora],
    sampling: Sampling,
    chunked: Chunked, mixed: Mixed, sampled: Sampled,
) -> None:
"""

_VARIABLE: Final = {Idle: "idle_", Extended: "extended", Decoding: "decoding", Filtered: "filtered"}
_CALL: Final = {
    "extend": "extend({}, reqs, pools)",
    "admit_prefilled": "admit_prefilled({}, reqs, pools)",
    "decode": "decode({}, pools)",
    "filter_batch": "filter_batch({}, [0])",
    "split": "split({}, [0])",
}


def _illegal_transitions() -> dict[str, str]:
    # Every (phase, function) pair that is not a row of TRANSITIONS.
    cases: dict[str, str] = {}
    for name, call in _CALL.items():
        legal = {row.source for row in TRANSITIONS if row.function.__name__ == name}
        for phase, variable in _VARIABLE.items():
            if phase not in legal:
                cases[f"reject_{name}_from_{variable.rstrip('_')}"] = call.format(variable)
    sides = [(row.source, row.operand) for row in TRANSITIONS if row.function is merge]
    for left, left_variable in _VARIABLE.items():
        for right, right_variable in _VARIABLE.items():
            if (left, right) not in sides:
                key = f"reject_merge_{left_variable.rstrip('_')}_with_{right_variable.rstrip('_')}"
                cases[key] = f"merge({left_variable}, {right_variable})"
    return cases


REJECTED: Final = {
    **_illegal_transitions(),
    # A mirror is built from host data only; there is no constructor taking one side.
    "reject_mirror_from_one_side": "Mirrored(tensor)",
    "reject_mirror_from_two_sides": "Mirrored(host=tensor, device=tensor)",
    "reject_mirror_from_device_tensor_as_device": "Mirrored.from_host(tensor, tensor)",
    # Records and pairs are frozen.
    "reject_assign_record_field": "decoding.rows = filtered.rows",
    "reject_assign_mirror_side": "pair.host = tensor",
    "reject_assign_pools_field": "pools.free_slots = tensor",
    # Extend-only data lives only on Extended.
    "reject_prefix_lens_on_decoding": "print(decoding.prefix_lens)",
    "reject_input_ids_on_filtered": "print(filtered.input_ids)",
    # A failure is a value: a Result must be unwrapped before use.
    "reject_result_used_as_step": "print(decode(decoding, pools).batch)",
    # Seed 000: a consumer that needs the mirror cannot be handed a device-only tensor or None.
    "reject_device_only_where_mirror_needed": (
        "def plan(seq_lens: Mirrored) -> None: ...\nplan(device_only)"
    ),
    "reject_none_where_mirror_needed": "def plan(seq_lens: Mirrored) -> None: ...\nplan(None)",
    "reject_out_cache_loc_as_mirror": (
        "def plan(locs: Mirrored) -> None: ...\nplan(decoding.out_cache_loc)"
    ),
    # Columns: declared once, typed everywhere.
    "reject_undeclared_column": "print(with_sampling.rows.columns.adapter)",
    "reject_merge_different_columns": "merge(with_sampling, lora)",
    "reject_columns_of_another_set": (
        "def serve(batch: Decoding[Lora]) -> None: ...\nserve(with_sampling)"
    ),
    "reject_columns_into_plain_batch": (
        "def plain(batch: Decoding) -> None: ...\n"
        "plain(decode(with_sampling, pools).unwrap().batch)"
    ),
    "reject_extend_without_columns": "extend(sampling_idle, reqs, pools)",
    # One pools type: a batch or a held chunk where the pools go is refused.
    "reject_decode_with_batch_as_pools": "decode(filtered, filtered)",
    "reject_flush_a_batch": "flush(filtered)",
    "reject_pools_as_a_holder": "check_leaks(pools, [filtered, pools])",
    "reject_release_tokens_of_ints": "release(filtered, idle_, pools, [1, 2])",
    # A held chunk is not a batch: it can only be mixed again or released.
    "reject_decode_from_chunked": "decode(chunked, pools)",
    "reject_merge_chunked_into_filtered": "merge(filtered, chunked)",
    "reject_filter_chunked": "filter_batch(chunked, [0])",
    "reject_chunked_rows": "print(chunked.rows)",
    # A mixed forward is settled before anything else touches it.
    "reject_decode_from_mixed": "decode(mixed, pools)",
    "reject_filter_mixed": "filter_batch(mixed, [0])",
    "reject_merge_mixed": "merge(filtered, mixed)",
    "reject_release_mixed": "release(mixed, filtered, pools)",
    "reject_check_batch_mixed": "check_batch(mixed)",
    "reject_mix_from_decoding": "mix(decoding, reqs, 8, pools)",
    "reject_mix_from_extended": "mix(extended, reqs, 8, pools)",
    "reject_finish_mixed_filtered": "finish_mixed(filtered)",
    # Device-resident tokens are device-only: no host side to read, no host list where they go.
    "reject_sampled_tokens_as_mirror": "def plan(t: Mirrored) -> None: ...\nplan(sampled.tokens)",
    "reject_decode_sampled_host_tokens": "decode_sampled(filtered, [1, 2], pools)",
    "reject_decode_sampled_from_decoding": "decode_sampled(decoding, sampled, pools)",
}

ACCEPTED: Final = {
    "accept_decode_loop": """\
        step = extend(idle_, reqs, pools).unwrap()
        batch: Extended | Decoding | Filtered = step.batch
        pools = step.pools
        for _ in range(3):
            decoded, pools = decode(batch, pools).unwrap()
            batch = filter_batch(decoded, [0])
        kept, left = split(batch, [])
        pools = release(left, kept, pools).unwrap()
        running = merge(idle_, filter_batch(batch, [0]))
        assert running.rows.seq_lens.host.sum() >= 0
    """,
    "accept_mirrored_consumer": """\
        def plan(seq_lens: Mirrored) -> int:
            return int(seq_lens.host.sum())
        plan(decoding.rows.seq_lens)
        plan(extended.rows.req_pool_indices)
    """,
    "accept_columns_through_every_transition": """\
        step = extend(sampling_idle, reqs, pools, sampling).unwrap()
        decoded, pools = decode(step.batch, pools).unwrap()
        kept, left = split(decoded, [0])
        pools = release(left, kept, pools).unwrap()
        running: Filtered[Sampling] = merge(kept, step.batch)
        temperature: Mirrored[np.float32] = running.rows.columns.temperature
        print(temperature.host.tolist())
    """,
    "accept_cached_loop": """\
        shared = make_pools(4, 64, 256, torch.device("cpu"), 16, prefix_cache=True)
        step = extend(idle_, reqs, shared).unwrap()
        decoded, shared = decode(step.batch, step.pools).unwrap()
        kept, left = split(decoded, [0])
        shared = release(left, kept, shared, [req.input_ids for req in left.reqs]).unwrap()
        check_pools(shared, [kept])
        hit: int = int(step.batch.prefix_lens[0])
        shared = flush(shared)
        print(hit, shared.cache.num_pages, shared.num_available_tokens)
    """,
    "accept_overlap_loop": """\
        step = mix(filtered, [chunked, *reqs], 64, pools, sampled).unwrap()
        running, held = finish_mixed(step.batch)
        tokens = gather_sampled(Sampled.of(step.batch.rows, tensor), running)
        decoded = decode_sampled(running, tokens, step.pools).unwrap()
        pools = release(held[0], finish_mixed(decoded.batch).running, decoded.pools).unwrap()
        check_leaks(pools, [running, *held, decoded.batch])
        print(read_sampled(tokens).tolist())
    """,
    # An extend's prefix and extend lengths are of one type with a mixed forward's.
    "accept_prefix_lens_of_one_type": """\
        def cached(lens: npt.NDArray[np.int64]) -> int:
            return int(lens.sum())
        print(cached(extended.prefix_lens) + cached(mixed.prefix_lens))
        print(cached(extended.extend_lens) + cached(mixed.extend_lens))
    """,
    # Holders of different column sets check together, with no annotation.
    "accept_leaks_of_any_column_set": """\
        check_leaks(pools, [lora, sampling_idle, chunked, filtered, mixed, with_sampling])
        leaks = find_leaks(pools, (decoding, chunked))
        print(leaks.unheld)
    """,
    "accept_failure_handling": """\
        result = decode(filtered, pools)
        if isinstance(result, Success):
            print(result.unwrap().batch.out_cache_loc)
        else:
            error: OutOfKVTokens | ContextTooLong = result.failure()
            print(error)
    """,
}


def _module(body: str) -> str:
    # Plain entries are one statement, nested entries are already indented blocks.
    lines = textwrap.dedent(body).strip("\n")
    return _PRELUDE + textwrap.indent(lines, "    ") + "\n"


@functools.cache
def _errors() -> dict[str, list[str]]:
    accepted_imports = "from returns.result import Success\n"
    modules = {name: _module(code) for name, code in REJECTED.items()}
    modules |= {name: accepted_imports + _module(code) for name, code in ACCEPTED.items()}
    return mypy_errors(modules)


def test_illegal_pairs_are_the_complement_of_the_table() -> None:
    """Four phases by five one-batch transitions, and 4 x 4 merge pairs, less the legal rows."""
    illegal = _illegal_transitions()
    assert len(illegal) == (3 + 3 + 1 + 1 + 1) + (16 - 6)
    assert illegal["reject_decode_from_idle"] == "decode(idle_, pools)"
    assert illegal["reject_merge_extended_with_filtered"] == "merge(extended, filtered)"


# The reason each hand-written case must fail for; the generated ones are all [arg-type]
# (extend and admit_prefilled, overloaded on whether the batch carries columns: [call-overload]).
_REASON: Final = {
    "reject_undeclared_column": "[attr-defined]",
    "reject_result_used_as_step": "[attr-defined]",
    "reject_release_tokens_of_ints": "[list-item]",
    "reject_pools_as_a_holder": "[list-item]",
    "reject_merge_different_columns": "Cannot infer value of type parameter",
    "reject_extend_without_columns": "[arg-type]",
    "reject_mirror_from_one_side": "[call-arg]",
    "reject_mirror_from_two_sides": "[call-arg]",
    "reject_assign_record_field": "is read-only",
    "reject_assign_mirror_side": "is read-only",
    "reject_assign_pools_field": "is read-only",
    "reject_prefix_lens_on_decoding": "[attr-defined]",
    "reject_input_ids_on_filtered": "[attr-defined]",
    "reject_chunked_rows": "[attr-defined]",
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_mypy_rejects(name: str) -> None:
    """mypy reports an error, for the intended reason, on code that breaks the model."""
    errors = _errors()[name]
    assert errors, f"mypy accepted {name}:\n{_module(REJECTED[name])}"
    overloaded = name.startswith(("reject_extend_", "reject_admit_prefilled_", "reject_mix_"))
    reason = _REASON.get(name, "[call-overload]" if overloaded else "[arg-type]")
    assert any(reason in error for error in errors), errors


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_mypy_accepts(name: str) -> None:
    """mypy accepts the ordinary uses of the API."""
    assert _errors()[name] == [], _errors()[name]
