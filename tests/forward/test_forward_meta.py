"""forward_inputs and pad read nothing from the device: on meta, under a forbidding audit."""

from __future__ import annotations

import pytest
import torch
from benchmarks.counting import count_device_work

from batchstate import pad, unpad
from batchstate.audit import device_reads
from tests.forward_cases import PHASE_NAMES, build, make_pools_for, make_record

META = torch.device("meta")


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_on_meta_one_copy_and_only_the_page_gathers(phase: str, page_size: int) -> None:
    """One host-to-device copy each; the device runs the page gathers and the pads, nothing else."""
    record, pools = make_record(phase, (1, 3, 17, 40), make_pools_for(page_size, META))
    with device_reads(forbid=True) as log:
        with count_device_work() as built:
            inputs = build(record, pools)
        with count_device_work() as padded_work:
            padded = pad(inputs, [64, 128]).unwrap()
        output = padded.run(lambda fi: torch.empty(fi.num_tokens, 4, device=META))
        with count_device_work() as unpadded_work:
            rows = unpad(output)
    assert log.report().count == 0
    assert built.copies == 1
    # Gather the page-start cells, pick each row's pages; divide locations by the page size.
    assert built.kernels == (2 if page_size == 1 else 3)
    assert (padded_work.copies, padded_work.kernels) == (1, 3)  # kv_indices, page_table, locations
    assert unpadded_work.copies == 0
    assert unpadded_work.kernels <= 1  # a slice for decode, one gather otherwise
    assert rows.shape == (inputs.num_rows, 4)
