"""The device copies a forward on hybrid pools performs for the prefix cache's anchors.

A row that resumes from an anchor (`cache.anchors`) reads its window tail
and state through copies into its own window pages and state slot, made
before the forward's window and state layers run; a row that publishes an
anchor fills it during the forward: its window tail copied into the
anchor's window pages once the layer wrote the new tokens' KV, its state
after the anchor's last token written into the anchor's state slot by the
recurrent layer (a checkpoint). All of it from host values of the pools:
nothing is read from the device.
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np

from batchstate.base.mirrored import HostArray, Mirrored
from batchstate.cache.anchors import HybridCache, ResumePoint
from batchstate.cache.radix import Tokens
from batchstate.forward.inputs import ForwardInputs, ForwardInputsError
from batchstate.memory.window_pages import WindowPages

__all__ = ["CachedCopies", "cached_copies"]


@final
@attrs.frozen(eq=False, repr=False)
class CachedCopies:
    """The anchor copies of one forward; every copy reads before any writes.

    Before the window and state layers (each layer, its own buffers):
    `window_from[j]` -> `window_to[j]` (window pages, a page of token
    slots each) and `state_from[j]` -> `state_to[j]` (state slots). After
    a window layer wrote the new tokens' KV: `publish_from[j]` ->
    `publish_to[j]` (window pages). A recurrent layer writes its state
    after forward token `checkpoint_tokens[j]` into `checkpoint_states[j]`.
    All int64; window entries are empty without window layers, state
    entries without recurrent layers.
    """

    window_from: Mirrored
    window_to: Mirrored
    state_from: Mirrored
    state_to: Mirrored
    publish_from: Mirrored
    publish_to: Mirrored
    checkpoint_tokens: Mirrored
    checkpoint_states: Mirrored

    def __repr__(self) -> str:
        return (
            f"CachedCopies(resumed_pages={len(self.window_from)}, states={len(self.state_from)},"
            f" published_pages={len(self.publish_from)}, checkpoints={len(self.checkpoint_tokens)})"
        )


def cached_copies(
    inputs: ForwardInputs,
    cached: HybridCache,
    window: WindowPages | None,
    of_slot: HostArray | None,
) -> tuple[CachedCopies, ...]:
    """The copies the forward `inputs` performs for anchors, () when it performs none.

    `window`: the window layers' pages (None without window layers);
    `of_slot`: request slot -> state slot, of recurrent layers.

    Raises:
        ForwardInputsError: a row resumes from or publishes an anchor the
            cache no longer keeps (its window tail evicted): its forward
            would read a prefix as if it were whole.
    """
    if not cached.pending:
        return ()
    slots = inputs.req_pool_indices.host
    seq = inputs.seq_lens.host.astype(np.int64)
    firsts = seq - inputs.extend_lens.host.astype(np.int64)
    qo = inputs.qo_indptr.host.astype(np.int64)
    parts: list[list[int]] = [[] for _ in range(8)]
    for row, (slot, first, end) in enumerate(
        zip(slots.tolist(), firsts.tolist(), seq.tolist(), strict=True)
    ):
        copies = cached.pending.get(slot) if slot else None
        if copies is None:
            continue
        if copies.resume and len(copies.resume) == first:
            anchor = _kept(cached, copies.resume, slot)
            if window is not None:
                parts[0] += anchor.window_pages
                parts[1] += window.tail_pages(slot, first).tolist()
            if of_slot is not None:
                parts[2].append(anchor.state)
                parts[3].append(int(of_slot[slot]))
        if copies.publish and first < len(copies.publish) <= end:
            anchor = _kept(cached, copies.publish, slot)
            stop = len(copies.publish)
            if window is not None:
                parts[4] += window.tail_pages(slot, stop).tolist()
                parts[5] += anchor.window_pages
            if of_slot is not None:
                parts[6].append(int(qo[row]) + stop - 1 - first)
                parts[7].append(anchor.state)
    if not any(parts):
        return ()
    hosts = [np.array(part, dtype=np.int64) for part in parts]
    return (CachedCopies(*Mirrored.from_hosts(hosts, inputs.device)),)


def _kept(cached: HybridCache, prefix: Tokens, slot: int) -> ResumePoint:
    anchor = cached.anchors.get(prefix)
    if anchor is None:
        raise ForwardInputsError(
            f"hybrid_inputs: slot {slot} reads a cached prefix of {len(prefix)} tokens whose"
            " window tail and state the cache no longer keeps: it cannot be read as if whole"
        )
    return anchor
