"""A column set's mismatch is a mypy error wherever records flow; a match infers the exact set.

Without `batchstate.mypy_plugin`, mypy solves a nested call's column set
from the outer call's context, and a mismatch inside (`decode(merge(f, e),
pools)`) comes out as `Decoding[Any]` with no error; so does a call passed
where `Any` goes. The plugin solves the set from the arguments alone. All
snippets go through one mypy run; each test reads its own.
"""

from __future__ import annotations

import functools
import textwrap
from typing import Final

import pytest

from tests.typecheck import Report, mypy_reports

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

_PRELUDE: Final = """\
from typing import Any
import attrs
import numpy as np
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

def anything(value: Any) -> None: ...

def snippet(
    f: Filtered[Sampling], g: Filtered[Sampling], d: Decoding[Sampling],
    e: Extended[NoColumns], plain: Filtered, idle_: Idle, sampling_idle: Idle[Sampling],
    lora_idle: Idle[Lora], sampling: Sampling, lora: Lora, pools: Pools, reqs: list[Req],
    sampling_chunk: Chunked[Sampling], lora_chunk: Chunked[Lora],
) -> None:
"""

# Each must be an error naming the call whose arguments carry two sets.
MISMATCHED: Final = {
    "merge": ("merge(f, e)", "merge"),
    "merge_nested_in_decode": ("decode(merge(f, e), pools)", "merge"),
    "merge_nested_twice": ("unwrap(decode(merge(f, e), pools)).batch", "merge"),
    "merge_of_a_nested_filter": ("decode(merge(f, filter_batch(e, [0])), pools)", "merge"),
    "merge_of_a_filter_where_any_goes": ("anything(merge(filter_batch(f, [0]), e))", "merge"),
    "merge_into_filter": ("filter_batch(merge(d, e), [0])", "merge"),
    "merge_into_check": ("check_batch(merge(f, plain))", "merge"),
    "merge_where_any_goes": ("anything(merge(f, e))", "merge"),
    "extend_columns_of_another_set": ("extend(lora_idle, reqs, pools, sampling)", "extend"),
    "extend_nested": ("unwrap(extend(lora_idle, reqs, pools, sampling))", "extend"),
    "extend_where_any_goes": ("anything(extend(sampling_idle, reqs, pools, lora))", "extend"),
    "extend_a_chunk_of_another_set": (
        "anything(extend(sampling_idle, [lora_chunk], pools, sampling))",
        "extend",
    ),
    "admit_prefilled_nested": (
        "unwrap(admit_prefilled(lora_idle, reqs, pools, sampling))",
        "admit_prefilled",
    ),
    "admit_prefilled_where_any_goes": (
        "anything(admit_prefilled(lora_idle, reqs, pools, sampling))",
        "admit_prefilled",
    ),
    "mix_columns_of_another_set": ("mix(f, reqs, 8, pools, (), lora)", "mix"),
    "mix_where_any_goes": ("anything(mix(f, reqs, 8, pools, (), lora))", "mix"),
    "mix_nested": (
        "finish_mixed(unwrap(mix(idle('cpu', Lora), reqs, 8, pools, (), sampling)).batch)",
        "mix",
    ),
    "mix_a_chunk_of_another_set": ("anything(mix(f, [lora_chunk], 8, pools, (), sampling))", "mix"),
}

# Each passes, and reveals exactly the set its arguments carry, in any context.
MATCHED: Final = {
    "merge_nested_in_decode": (
        "reveal_type(unwrap(decode(merge(f, g), pools)).batch)",
        "batchstate.records.phases.Decoding[batchstate.columns.sampling.Sampling]",
    ),
    "merge_of_nested_calls": (
        "reveal_type(merge(filter_batch(d, [0]),"
        " filter_batch(unwrap(decode(g, pools)).batch, [0])))",
        "batchstate.records.phases.Filtered[batchstate.columns.sampling.Sampling]",
    ),
    "filter_where_any_goes": (
        "anything(reveal_type(filter_batch(f, [0])))",
        "batchstate.records.phases.Filtered[batchstate.columns.sampling.Sampling]",
    ),
    "merge_where_any_goes": (
        "anything(reveal_type(merge(d, f)))",
        "batchstate.records.phases.Filtered[batchstate.columns.sampling.Sampling]",
    ),
    "default_set": (
        "reveal_type(unwrap(decode(merge(idle_, e), pools)).batch)",
        "batchstate.records.phases.Decoding[batchstate.columns.columns.NoColumns]",
    ),
    "extend_nested": (
        "reveal_type(unwrap(extend(sampling_idle, [sampling_chunk, *reqs], pools, sampling))"
        ".batch)",
        "batchstate.records.phases.Extended[batchstate.columns.sampling.Sampling]",
    ),
    "extend_where_any_goes": (
        "anything(reveal_type(unwrap(extend(lora_idle, reqs, pools, lora)).batch))",
        "batchstate.records.phases.Extended[test_column_flow_typing_matched_extend_where_any_goes.Lora]",
    ),
    "mix_nested": (
        "reveal_type(finish_mixed(unwrap(mix(f, reqs, 8, pools, (), sampling)).batch).running)",
        "batchstate.records.phases.Filtered[batchstate.columns.sampling.Sampling]",
    ),
    "idle_where_any_goes": (
        "anything(reveal_type(idle('cpu', Lora)))",
        "batchstate.records.phases.Idle[test_column_flow_typing_matched_idle_where_any_goes.Lora]",
    ),
}


def _module(body: str) -> str:
    return _PRELUDE + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"


@functools.cache
def _reports() -> dict[str, Report]:
    modules = {
        f"test_column_flow_typing_mismatched_{name}": _module(code)
        for name, (code, _) in MISMATCHED.items()
    }
    modules |= {
        f"test_column_flow_typing_matched_{name}": _module(code)
        for name, (code, _) in MATCHED.items()
    }
    return mypy_reports(modules)


@pytest.mark.parametrize("name", sorted(MISMATCHED))
def test_a_mismatch_is_an_error_wherever_records_flow(name: str) -> None:
    code, function = MISMATCHED[name]
    errors = _reports()[f"test_column_flow_typing_mismatched_{name}"].errors
    differ = [error for error in errors if error.startswith("Column sets differ")]
    assert differ, f"mypy accepted {code}: {errors}"
    assert all(error.endswith("[arg-type]") for error in differ), differ
    assert f'in a call to "{function}": ' in differ[0], differ


def test_the_error_names_each_argument_and_its_set() -> None:
    (error,) = [
        error
        for error in _reports()["test_column_flow_typing_mismatched_merge_nested_in_decode"].errors
    ]
    assert error == (
        'Column sets differ in a call to "merge": "Sampling" (running), "NoColumns"'
        " (incoming); the records and columns of one call carry one column set  [arg-type]"
    )


@pytest.mark.parametrize("name", sorted(MATCHED))
def test_a_match_infers_the_exact_set(name: str) -> None:
    report = _reports()[f"test_column_flow_typing_matched_{name}"]
    assert report.errors == []
    assert report.revealed == [MATCHED[name][1]]
