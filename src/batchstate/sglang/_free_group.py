"""SGLang's free KV tokens as of now, counting frees an open free group holds back."""

from __future__ import annotations

from typing import Any

import torch


def free_tokens(allocator: Any) -> int:
    """The allocator's free tokens, counting those an open free group holds back.

    SGLang's result processing frees inside `free_group_begin` / `free_group_end` (one
    free for the whole batch): a request released there has given its pages back,
    though `available_size()` shows them only at the group's end. Pages freed by id
    are counted from their tensors' sizes; tokens freed one by one are deduplicated to
    their pages (a device read only on that path, only while a group is open).
    """
    available = int(allocator.available_size())
    by_id = getattr(allocator, "free_page_ids_group", None)
    by_token = getattr(allocator, "free_group", None)
    if not by_id and not by_token:  # no group open: every call between result processings
        return available
    page = int(allocator.page_size)
    pending = sum(int(ids.numel()) for ids in by_id or [])
    if by_token:
        tokens = torch.cat([t.reshape(-1) for t in by_token])
        pending += int(torch.unique(tokens // page).numel()) if page > 1 else int(tokens.numel())
    return available + pending * page
