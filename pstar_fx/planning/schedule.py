"""schedule: which chunk is resident in which compute slot at each node, and when its copy starts.

Two steps over the node sequence:

1. `belady(reads, n_slots)` decides residency. Before node i every chunk it reads must be resident; when
   all slots are full, the resident chunk whose next use is farthest in the future leaves (Belady's MIN,
   optimal for a known future — and the graph is the future). Output: residency intervals
   (chunk, first node, last node) — a chunk leaves right after the last use in its interval.
2. `place_prefetches(intervals, ...)` assigns intervals to slots and moves each copy earlier, as far as
   the cost model says the copy takes (bytes / link bandwidth against the estimated time of the nodes in
   between), but never before the slot's previous chunk has left.

Output: per node, ops to run before it (prefetch, fetch = wait for the copy) and after it (release).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Schedule:
    before: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    after: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    fetches: int = 0
    exposed_seconds: float = 0.0     # copy time the plan could not hide behind compute


def belady(reads: list[set[int]], n_slots: int) -> list[tuple[int, int, int]]:
    """Residency intervals (chunk, start node, end node) with the fewest fetches for `n_slots` slots."""
    uses: dict[int, list[int]] = {}
    for i, r in enumerate(reads):
        for c in r:
            uses.setdefault(c, []).append(i)
    if any(len(r) > n_slots for r in reads):
        raise ValueError(f"a node reads {max(len(r) for r in reads)} chunks at once but only {n_slots} slots exist")
    ptr = {c: 0 for c in uses}

    def next_use(c: int, i: int) -> float:
        u = uses[c]
        while ptr[c] < len(u) and u[ptr[c]] < i:
            ptr[c] += 1
        return u[ptr[c]] if ptr[c] < len(u) else float("inf")

    open_: dict[int, list[int]] = {}        # chunk -> [start, last use so far]
    intervals: list[tuple[int, int, int]] = []
    for i, r in enumerate(reads):
        for c in sorted(r):
            if c in open_:
                open_[c][1] = i
                continue
            if len(open_) >= n_slots:
                victim = max((v for v in open_ if v not in r), key=lambda v: next_use(v, i))
                start, last = open_.pop(victim)
                intervals.append((victim, start, last))
            open_[c] = [i, i]
    intervals += [(c, s, e) for c, (s, e) in open_.items()]
    return sorted(intervals, key=lambda t: (t[1], t[0]))


def place_prefetches(intervals: list[tuple[int, int, int]], n_slots: int, node_seconds: list[float],
                     copy_seconds: dict[int, float]) -> Schedule:
    """Turn residency intervals into prefetch/fetch/release ops, each copy queued as soon as its slot is free.

    The copies run one after another on one copy stream (the runtime's "h2d": movers.py), in the order they are
    queued, each once its slot's previous chunk has left; so they are timed as that stream runs them, not each
    against the compute alone (two copies in flight share one link). A fetch whose copy has not landed stalls the
    compute, and everything after it runs that much later (`Schedule.exposed_seconds`). Each copy is queued as
    early as its slot allows, in the order of the fetches: queued later, it only leaves the stream idle before it,
    and the launching thread, which queues it, may by then be waiting on the host (for a host gradient buffer:
    2.3 s a step at `GPT3_18B` with fp32 moments on the H200). Before, each copy was queued just early enough to
    hide it alone; on an H100 box, `GPT3_10B` with fp32 moments (25 host chunks crossing as fp32) ran 2.404 s a step
    that way and 2.341 s this way, its compute waiting 0.48 and 0.43 s for copies (bench/RESULTS.md, session 27)."""
    sched = Schedule()
    slot_free_after = [-1] * n_slots            # node index after which each slot is empty
    prefix = [0.0]
    for t in node_seconds:
        prefix.append(prefix[-1] + t)
    stall_nodes: list[int] = []                 # fetch nodes where the compute waited, in order
    stalled: list[float] = []                   # the compute's waits so far, through each of those nodes

    def waited_through(i: int) -> float:        # the compute's waits at the fetches of nodes 0..i
        k = bisect.bisect_right(stall_nodes, i)
        return stalled[k - 1] if k else 0.0

    copies_done = 0.0                           # when the copy stream has run every copy queued so far
    queued = 0                                  # the node before which the last copy was queued
    for chunk, start, end in intervals:
        slot = min(range(n_slots), key=lambda s: slot_free_after[s])
        earliest = slot_free_after[slot] + 1
        if earliest > start:
            raise AssertionError("more chunks resident than slots: belady() output is inconsistent")
        issue = max(earliest, queued)
        # the copy starts once the stream is free and the slot's previous chunk has been read for the last time
        slot_read = prefix[earliest] + waited_through(earliest - 1) if earliest > 0 else 0.0
        copies_done = max(copies_done, slot_read) + copy_seconds.get(chunk, 0.0)
        before = waited_through(start)
        wait = max(0.0, copies_done - (prefix[start] + before))
        if wait > 0.0:
            stall_nodes.append(start)
            stalled.append(before + wait)
            sched.exposed_seconds += wait
        if issue < start:
            sched.before.setdefault(issue, []).append(("prefetch", chunk))
        sched.before.setdefault(start, []).append(("fetch", chunk))
        sched.after.setdefault(end, []).append(("release", chunk))
        slot_free_after[slot] = end
        queued = issue
        sched.fetches += 1
    return sched
