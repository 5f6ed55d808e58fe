"""pad and unpad: real rows unchanged, padded rows filled, offsets consistent, a clean way back."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    PAD_FIELDS,
    SGLANG_PAD_VALUES,
    VLLM_PAD_VALUES,
    ForwardInputs,
    Padded,
    PaddingError,
    TooLargeToPad,
    captured_size,
    pad,
    unpad,
    unpad_tokens,
)
from tests.forward_cases import LENGTHS, PAGE_SIZES, PHASE_NAMES, build, make_pools_for, make_record

_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_PER_ROW = ("req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "kv_last_page_len")


def _inputs(phase: str, page_size: int, lengths: tuple[int, ...]) -> ForwardInputs:
    record, pools = make_record(phase, lengths, make_pools_for(page_size))
    return build(record, pools)


def _offsets(lens: np.ndarray) -> list[int]:
    return [0, *np.cumsum(lens).tolist()]


def _check_padded(inputs: ForwardInputs, padded: Padded, fills: Mapping[str, int]) -> None:
    out = padded.inputs
    n, t, p = inputs.num_rows, inputs.num_tokens, inputs.page_size
    assert (padded.num_real_rows, padded.num_real_tokens) == (n, t)
    assert out.num_tokens in _SIZES and out.num_tokens >= t
    # Real rows and tokens unchanged, on both sides.
    for name in (*_PER_ROW, "positions", "qo_indptr", "kv_indptr", "cu_seqlens_k", "sample_index"):
        before, after = getattr(inputs, name), getattr(out, name)
        size = len(before)
        assert after.host[:size].tolist() == before.host.tolist(), name
        assert after.device[:size].tolist() == before.host.tolist(), name
        assert after.device.tolist() == after.host.tolist(), name
    assert out.kv_indices.device[: inputs.num_pages].tolist() == inputs.kv_indices.device.tolist()
    assert out.out_cache_loc.device[:t].tolist() == inputs.out_cache_loc.device.tolist()
    # Padded rows and tokens carry their fill values.
    added = out.num_rows - n
    if inputs.is_decode:
        assert out.num_rows == out.num_tokens
        for name in ("req_pool_indices", "seq_lens", "extend_lens"):
            assert getattr(out, name).host[n:].tolist() == [fills[name]] * added, name
    else:
        assert added == 0
    assert out.positions.host[t:].tolist() == [fills["positions"]] * (out.num_tokens - t)
    assert out.out_cache_loc.device[t:].tolist() == [fills["out_cache_loc"]] * (out.num_tokens - t)
    assert out.kv_indices.device[inputs.num_pages :].tolist() == [fills["kv_indices"]] * (
        out.num_pages - inputs.num_pages
    )
    # Sums and offsets agree with the per-row lengths.
    seq = out.seq_lens.host.astype(np.int64)
    assert out.seq_lens_sum == int(seq.sum())
    assert out.qo_indptr.host.tolist() == _offsets(out.extend_lens.host)
    assert out.cu_seqlens_k.host.tolist() == _offsets(seq)
    assert out.kv_indptr.host.tolist() == _offsets(-(-seq // p))
    assert int(out.qo_indptr.host[-1]) <= out.num_tokens
    assert out.num_pages == int(out.kv_indptr.host[-1]) == len(out.kv_indices)
    assert np.array_equal(out.prefix_lens.host + out.extend_lens.host, out.seq_lens.host)
    # A static page-table width: the table's full row, in pages.
    assert tuple(out.page_table.device.shape) == (out.num_rows, inputs.table_pages)


@pytest.mark.parametrize("fills", [SGLANG_PAD_VALUES, VLLM_PAD_VALUES], ids=["sglang", "vllm"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_pad_invariants(
    phase: str, page_size: int, lengths: tuple[int, ...], fills: Mapping[str, int]
) -> None:
    """Every phase pads to the next captured size with its fills; unpad gives the real rows back."""
    inputs = _inputs(phase, page_size, lengths)
    padded = pad(inputs, _SIZES, fills).unwrap()
    _check_padded(inputs, padded, fills)
    # A forward whose output names its token: unpad keeps each real row's last token.
    output = padded.run(lambda fi: torch.arange(fi.num_tokens) * 10)
    assert unpad(output).tolist() == [10 * i for i in inputs.sample_index.host.tolist()]
    assert unpad_tokens(output).tolist() == [10 * i for i in range(inputs.num_tokens)]


def test_decode_pads_rows_and_prefill_pads_tokens() -> None:
    """Three decode rows go to four; a 20-token prefill gains 12 tokens and no row."""
    decode = pad(_inputs("decoding", 16, (3, 4, 5)), [2, 4, 8]).unwrap()
    assert (decode.padded_rows, decode.padded_tokens) == (1, 1)
    assert decode.inputs.seq_lens_sum == 4 + 5 + 6 + SGLANG_PAD_VALUES["seq_lens"]
    prefill = pad(_inputs("extended", 16, (8, 12)), [16, 32]).unwrap()
    assert (prefill.padded_rows, prefill.padded_tokens) == (0, 12)
    assert prefill.inputs.qo_indptr.host.tolist() == [0, 8, 20]


def test_too_large_is_a_failure_and_data_parallel_takes_the_largest_rank() -> None:
    """Past the largest size: Failure; `at_least` pads to the bucket of the largest rank."""
    inputs = _inputs("decoding", 1, (3, 4, 5))
    assert pad(inputs, [1, 2]) == Failure(TooLargeToPad(3, 2))
    assert str(TooLargeToPad(3, 2)) == "3 tokens exceed the largest captured size, 2"
    ranks = [3, 9, 0]  # tokens per rank, as the ranks exchange them
    padded = pad(inputs, [4, 8, 16], at_least=max(ranks)).unwrap()
    assert padded.inputs.num_rows == 16
    idle = pad(_inputs("idle", 1, ()), [4, 8, 16], at_least=max(ranks)).unwrap()
    assert (idle.inputs.num_rows, idle.num_real_rows) == (16, 0)
    assert captured_size([4, 8, 16], 17) == Failure(TooLargeToPad(17, 16))
    assert captured_size([4, 8, 16], 5).unwrap() == 8


def test_pad_rows_and_tokens_of_engine_tensors() -> None:
    """Input ids and per-row columns pad to the padded counts; a wrong length is refused."""
    padded = pad(_inputs("decoding", 1, (3, 4, 5)), [8]).unwrap()
    assert padded.pad_tokens(torch.tensor([7, 8, 9])).tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert padded.pad_rows(torch.ones(3, 2), 5.0)[:, 0].tolist() == [1, 1, 1, 5, 5, 5, 5, 5]
    with pytest.raises(PaddingError, match="expected 3"):
        padded.pad_tokens(torch.tensor([1, 2]))
    with pytest.raises(PaddingError, match="8 tokens"):
        padded.wrap(torch.zeros(3))


def _snapshot(inputs: ForwardInputs) -> dict[str, list[int]]:
    names = (*_PER_ROW, "positions", "qo_indptr", "kv_indptr")
    return {name: getattr(inputs, name).host.tolist() for name in names} | {
        "kv_indices": inputs.kv_indices.device.tolist()
    }


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ([], "non-empty"),
        ([4, 2, 8], "strictly increasing"),
        ([2, 2, 4], "strictly increasing"),
        ([0, 4], ">= 1"),
        ([-4, 4], ">= 1"),
        ([2.0, 4], "ints"),
        ([True, 4], "ints"),
    ],
)
def test_bad_sizes_are_refused_and_change_nothing(sizes: list[int], match: str) -> None:
    """Unsorted, empty, non-positive or non-int sizes: PaddingError, inputs as they were."""
    inputs = _inputs("decoding", 16, (3, 4))
    before = _snapshot(inputs)
    with pytest.raises(PaddingError, match=match):
        pad(inputs, sizes)
    assert _snapshot(inputs) == before


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"positions": None}, "missing \\['positions'\\]"),
        ({"slot_mapping": -1}, "unknown \\['slot_mapping'\\]"),
        ({"seq_lens": 1.5}, "ints"),
        ({"extend_lens": 2}, "extend_lens must be 0 or 1"),
        ({"seq_lens": 0}, "seq_lens at least extend_lens"),
    ],
)
def test_bad_fills_are_refused_and_change_nothing(change: dict[str, object], match: str) -> None:
    """A fill table missing a field, naming an unknown one, or with bad values: PaddingError."""
    inputs = _inputs("decoding", 16, (3, 4))
    fills: dict[str, object] = {**SGLANG_PAD_VALUES, **change}
    fills = {name: value for name, value in fills.items() if value is not None}
    before = _snapshot(inputs)
    with pytest.raises(PaddingError, match=match):
        pad(inputs, [8], fills)  # type: ignore[arg-type]  # hostile on purpose
    assert _snapshot(inputs) == before
    assert set(PAD_FIELDS) == set(SGLANG_PAD_VALUES) == set(VLLM_PAD_VALUES)
