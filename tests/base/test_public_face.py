"""The public face: a small core, namespaces by concept, every older name still importable."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Final

import pytest
import torch

import batchstate
import batchstate.errors
from batchstate import Req, extend, idle, make_pools
from batchstate.base.lazy import typing_imports
from batchstate.base.results import Ok
from batchstate.errors import DoesNotFit, NotHeld, OutOfKVTokens, StalePools, TooLargeToPad
from tests.typecheck import mypy_reports

NAMESPACES: Final = (
    "base",
    "columns",
    "cache",
    "memory",
    "pools",
    "records",
    "transitions",
    "speculative",
    "forward",
    "captured",
    "checks",
    "errors",
)

# `batchstate.__all__` before the namespaces: each still imports from `batchstate`.
EARLIER_NAMES: Final = (
    "Ahead",
    "AheadStep",
    "AllocError",
    "Allocation",
    "Anchor",
    "Batch",
    "BatchConflict",
    "CachedCopies",
    "Chunked",
    "ColumnError",
    "Columns",
    "ContextTooLong",
    "DecodeError",
    "Decoding",
    "Departed",
    "DeviceOnly",
    "DoesNotFit",
    "DraftError",
    "EmptyExtend",
    "EmptyPrompt",
    "Err",
    "ExtendError",
    "Extended",
    "FILL_FIELDS",
    "FULL_ATTENTION",
    "Filtered",
    "ForwardInputs",
    "ForwardInputsError",
    "ForwardPhase",
    "FreeList",
    "GREEDY",
    "GraphBuffers",
    "GraphBuffersError",
    "Holder",
    "HostColumn",
    "HybridBuffers",
    "HybridCache",
    "HybridInputs",
    "HybridPools",
    "Idle",
    "InvariantViolation",
    "KeepIndicesError",
    "Leaks",
    "MemoryKindError",
    "MemoryKinds",
    "Mirrored",
    "MixError",
    "MixStep",
    "Mixed",
    "NoChunkBudget",
    "NoColumns",
    "NotHeld",
    "NotOwned",
    "Ok",
    "OutOfKVTokens",
    "OutOfReqSlots",
    "Outcome",
    "Padded",
    "PaddedOutput",
    "PaddingError",
    "PhaseError",
    "Pools",
    "PoolsArgumentError",
    "PrefixCache",
    "RecordShapeError",
    "RecurrentState",
    "ReleaseError",
    "Req",
    "Rows",
    "Running",
    "SGLANG_FILLS",
    "Sampled",
    "Sampling",
    "SamplingParams",
    "Settled",
    "SlidingWindow",
    "Split",
    "StalePools",
    "StaleRecord",
    "StateCopies",
    "StateInputs",
    "StateSlots",
    "Step",
    "StillRunning",
    "TRANSITIONS",
    "TokenTable",
    "TooLargeToPad",
    "TransferTargets",
    "Transition",
    "UnwrapError",
    "UpperBound",
    "VLLM_FILLS",
    "Verified",
    "VerifyStep",
    "Verifying",
    "WindowInputs",
    "WindowPages",
    "__version__",
    "accepted_states",
    "bucket",
    "build_columns",
    "check_batch",
    "check_leaks",
    "check_pools",
    "decode",
    "decode_sampled",
    "extend",
    "fill",
    "fill_hybrid",
    "filter_batch",
    "find_leaks",
    "flush",
    "follow",
    "forward_inputs",
    "hybrid_inputs",
    "idle",
    "join_sampled",
    "keep_indices",
    "make_pools",
    "merge",
    "mix",
    "outcome",
    "pad",
    "prebuilt",
    "read_sampled",
    "read_verified",
    "release",
    "settle",
    "settle_ahead",
    "split",
    "sync",
    "transfer_targets",
    "unpad",
    "unpad_tokens",
    "unwrap",
    "verify",
    "verify_ahead",
)


# Names renamed for one release: old name -> (its namespace, the new name).
RENAMED: Final = {
    "Ahead": ("speculative", "WindowAhead"),
    "AheadStep": ("speculative", "WindowAheadStep"),
    "Anchor": ("cache", "ResumePoint"),
    "FILL_FIELDS": ("captured", "PAD_FIELDS"),
    "Holder": ("checks", "SlotHolder"),
    "SGLANG_FILLS": ("captured", "SGLANG_PAD_VALUES"),
    "Settled": ("records", "FinishedMixed"),
    "Step": ("records", "BatchAndPools"),
    "VLLM_FILLS": ("captured", "VLLM_PAD_VALUES"),
    "bucket": ("captured", "captured_size"),
    "fill": ("captured", "fill_buffers"),
    "fill_hybrid": ("captured", "fill_hybrid_buffers"),
    "follow": ("transitions", "gather_sampled"),
    "prebuilt": ("transitions", "admit_prefilled"),
    "settle": ("transitions", "finish_mixed"),
    "settle_ahead": ("speculative", "exact_window"),
}
# The package's own result vocabulary, beside `returns`' (old name -> `returns`' own).
RESULTS: Final = {
    "Err": "returns.result.Failure",
    "Ok": "returns.result.Success",
    "Outcome": "returns.result.Result",
    "outcome": "the Result itself",
}


def test_the_core_is_small_and_every_earlier_name_still_imports() -> None:
    """Each earlier name loads; only the renamed ones and the result vocabulary warn."""
    assert 45 <= len(batchstate.__all__) <= 60
    warned: set[str] = set()
    for name in EARLIER_NAMES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hasattr(batchstate, name), name
        assert all(issubclass(w.category, DeprecationWarning) for w in caught), name
        if caught:
            warned.add(name)
    assert warned == set(RENAMED) | set(RESULTS)
    assert not (set(RENAMED) | set(RESULTS)) & set(batchstate.__all__)


def _renamed_cases() -> list[tuple[str, str]]:
    """(package, old name): each old name at the top level and in its namespace."""
    return [
        (package, old)
        for old, (namespace, _) in RENAMED.items()
        for package in ("batchstate", f"batchstate.{namespace}")
    ]


@pytest.mark.parametrize(("package", "old"), _renamed_cases())
def test_a_renamed_name_warns_names_its_replacement_and_is_the_same_object(
    package: str, old: str
) -> None:
    namespace, new = RENAMED[old]
    home = importlib.import_module(f"batchstate.{namespace}")
    module = importlib.import_module(package)
    pattern = rf"^{re.escape(package)}\.{old} is deprecated: use batchstate\.(\w+\.)?{new}$"
    with pytest.warns(DeprecationWarning, match=pattern) as caught:
        value = getattr(module, old)
    assert len(caught) == 1
    assert value is getattr(home, new)
    assert old not in module.__all__
    assert new in home.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(module, new) is value  # the new name does not warn
    with pytest.warns(DeprecationWarning):
        getattr(module, old)  # every lookup warns, not only the first


@pytest.mark.parametrize("old", sorted(RESULTS))
def test_the_result_vocabulary_warns_at_the_top_level_too(old: str) -> None:
    pattern = rf"^batchstate\.{old} is deprecated: use {re.escape(RESULTS[old])}"
    with pytest.warns(DeprecationWarning, match=pattern):
        value = getattr(batchstate, old)
    assert value is getattr(importlib.import_module("batchstate.base.results"), old)


@pytest.mark.xdist_group("mypy")  # the worker that runs mypy, its cache warm
def test_code_naming_the_old_names_still_type_checks() -> None:
    """mypy --strict reads each old name in its package's `__all__` (only at run time is it
    left out): code written against it keeps its types, with no attr-defined error."""
    imports = "\n".join(
        f"from {package} import {old}" for package, old in sorted(set(_renamed_cases()))
    )
    snippet = f"""\
{imports}
from batchstate import Filtered

def typed(step: Step[Filtered], finished: Settled) -> None:
    reveal_type(step.batch)
    reveal_type(follow)
"""
    report = mypy_reports({"old_names": snippet})["old_names"]
    assert report.errors == []
    assert report.revealed[0].startswith("batchstate.records.phases.Filtered")
    assert "(sampled: batchstate.transitions.sampled.Sampled, batch:" in report.revealed[1]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_each_namespace_loads_each_name_from_the_module_it_names(namespace: str) -> None:
    package = importlib.import_module(f"batchstate.{namespace}")
    sources = typing_imports(Path(str(package.__file__)))
    assert set(package.__all__) <= set(sources)
    for name, source in sources.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            value = getattr(package, name)
        assert value is getattr(importlib.import_module(source.module), source.name)


def test_every_core_name_is_also_in_a_namespace() -> None:
    """The core repeats names of the namespaces; it defines none of its own."""
    homes = {
        name
        for namespace in NAMESPACES
        for name in importlib.import_module(f"batchstate.{namespace}").__all__
    }
    assert set(batchstate.__all__) - homes == {"TRANSITIONS", "__version__"}


def test_importing_every_namespace_loads_no_torch() -> None:
    imports = "; ".join(f"import batchstate.{namespace}" for namespace in NAMESPACES)
    probe = f"import sys; {imports}; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == "False\n"


def test_a_deprecated_name_warns_and_names_its_replacement() -> None:
    with pytest.warns(DeprecationWarning, match="batchstate.base.Ok is deprecated: use returns"):
        ok = batchstate.base.Ok  # type: ignore[attr-defined]
    assert ok is Ok


def _library_classes() -> list[type]:
    found: list[type] = []
    skipped = ("mypy_plugin", "sglang", "__main__")
    for module in pkgutil.walk_packages(batchstate.__path__, "batchstate."):
        if any(part in module.name for part in skipped):
            continue
        loaded = importlib.import_module(module.name)
        found += [
            value
            for _, value in inspect.getmembers(loaded, inspect.isclass)
            if value.__module__ == module.name
        ]
    return found


def test_every_exception_batchstate_defines_derives_from_error() -> None:
    exceptions = [cls for cls in _library_classes() if issubclass(cls, BaseException)]
    assert len(exceptions) > 20
    assert [cls for cls in exceptions if not issubclass(cls, batchstate.errors.Error)] == []


def test_every_failure_value_derives_from_error_and_compares_by_value() -> None:
    failures: tuple[batchstate.errors.Error, ...] = (
        OutOfKVTokens(3, 1, 16, fits=2),
        NotHeld(7, 1, 5, 0),
        DoesNotFit("rows", 9, 8),
        TooLargeToPad(300, 256),
    )
    for failure in failures:
        copied = pickle.loads(pickle.dumps(failure))  # what ranks exchange
        assert copied == failure
        assert hash(copied) == hash(failure)
        assert copied is not failure
    assert pickle.loads(pickle.dumps(failures[0])).fits == 2  # keyword-only, kept


def test_except_error_catches_a_contract_broken_anywhere() -> None:
    pools = make_pools(4, 64, 64, torch.device("cpu"))
    extend(idle("cpu"), [Req(0, (1, 2, 3))], pools).unwrap()
    with pytest.raises(batchstate.errors.Error) as caught:
        extend(idle("cpu"), [Req(1, (4, 5))], pools)  # pools a success made stale
    assert isinstance(caught.value, StalePools)
    assert isinstance(caught.value, ValueError)
