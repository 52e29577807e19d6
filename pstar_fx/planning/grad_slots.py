"""grad_slots: the compute stream's waits for gradient slots whose last gradient is still being copied out.

Backward writes each chunk's gradient into a device gradient slot, from its first write to its update
(`ChunkUse.grad_first`, `adam_at`). A host chunk's gradient then crosses to the host (into a host gradient buffer,
its kept buffer or its shadow), and so does a device chunk's kept gradient that has no room on the device; the slot
goes back to the pool at once, and the next chunk to take it waits for that copy (runtime/movers.py `_grad_span`).
With one slot that is every such chunk's copy, minus the little compute between its update and the next chunk's
first gradient write: h4096 L90 with fp32 moments ships 35 host chunks' gradients of 0.54 GB a step, ~10 ms each at
the H200's 55 GB/s: 0.26 s a step by this model on a graph traced on the CPU, where the H200 box measured the
compute stream waiting 0.37 s for copies and the schedule's fetches explained 0.02 s (whether this is that wait is
not established: bench/RESULTS.md, session 23). A second slot lets the copy run while the next chunk's gradient is
written into the other (the pool hands out the slot given back longest ago first: runtime/store.py `Pool`).
"""
from __future__ import annotations

from collections import deque
from itertools import accumulate


def slot_waits(grad_first: dict[int, int], adam_at: dict[int, int], shipped: set[int], node_secs: list[float],
               n_slots: int, copy_seconds: float) -> float:
    """Seconds a step the compute stream waits to take a gradient slot whose last chunk's gradient (a chunk of
    `shipped`) is still crossing to the host: backward's chunks take slots at their first gradient write and give
    them back at their update, oldest given back first; the copies run one after another (one copy stream), each
    `copy_seconds` long, from its chunk's update on. Chunks updated on the device (not shipped) give theirs back
    ready. 0 without slots or gradients."""
    chunks = [c for c in grad_first if c in adam_at]
    if not chunks or n_slots < 1:
        return 0.0
    start = [0.0, *accumulate(node_secs)]            # start[i]: compute time before node i, stalls aside
    # at one node a chunk's update (and its slot given back) comes before another's first write
    events = sorted([(adam_at[c] + 1, 0, c) for c in chunks] + [(grad_first[c], 1, c) for c in chunks])
    free = deque([0.0] * n_slots)                    # each free slot: when its last copy out ends
    stalled = copy_free = 0.0
    for at, take, c in events:
        now = start[at] + stalled
        if take:
            if not free:                             # more gradients at once than slots: not this plan's
                return 0.0
            ready = free.popleft()
            stalled += max(0.0, ready - now)
        elif c in shipped:
            copy_free = max(now, copy_free) + copy_seconds
            free.append(copy_free)
        else:
            free.append(now)
    return stalled
