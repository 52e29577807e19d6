"""timeline: the plan along the step as plain data — bytes per tier, chunk moves and each chunk's tier, node by
node (what `pstar_fx.plot` draws). `timeline_of(plan)` builds it from the Plan's NodeProfile and moves, reading
the Plan by its fields (no import of plan.py: the Plan builds its timeline through this module)."""
from __future__ import annotations

from dataclasses import dataclass

# Timeline.tiers() codes, in priority order: a downsampled cell shows the highest code among its nodes
TIER_HOST, TIER_DEVICE, TIER_COPY_ON_DEVICE, TIER_MOVING = range(4)
TIER_NAMES = ("host", "device", "host, compute copy on device", "moving")


@dataclass
class Timeline:
    """The plan along the step as plain data. Index i is the i-th node of the planned graph: engine.graph in
    order without its chunk moves (rt.prefetch/fetch/release/offload/param; a move scheduled around node i
    is listed at i), with the parameter placeholders the rt.param views replaced. Events are (node, chunk)
    pairs, sorted."""
    node_names: list[str]
    device_bytes: list[int]          # predicted device bytes while node i runs: device_fixed_bytes + live values
    device_fixed_bytes: int          # chunk state, compute and gradient slots, buffers, margins: allocated once
    host_bytes: list[int]            # predicted host bytes (all allocated once, so flat)
    device_budget_bytes: int | None
    host_budget_bytes: int | None
    backward_start: int              # first backward node; == len(node_names) when there is no backward
    placement: list[str]             # chunk -> tier of its fp32 state
    prefetch_at: list[tuple[int, int]]   # a compute copy starts crossing to the device before node i
    fetch_at: list[tuple[int, int]]      # the copy must be in its device slot before node i (one per plan.fetches)
    release_at: list[tuple[int, int]]    # its slot is freed after node i
    update_at: list[tuple[int, int]]     # node i is rt.adam(c)
    offload_at: list[tuple[int, int]]    # a host chunk's gradients cross to the host, right before its update
    chunk_elems: int
    param_elems: int

    @property
    def nodes(self) -> int:
        return len(self.node_names)

    def tiers(self, columns: int | None = None, rows: int | None = None) -> list[bytearray]:
        """Each chunk's tier along the step: one bytearray per chunk (or per run of chunks, when `rows` is
        fewer), one TIER_* code per node (or per run of nodes, when `columns` is fewer). A cell covering
        several nodes or chunks holds the highest code among them, so a short move still shows."""
        n, n_chunks = self.nodes, len(self.placement)
        columns = n if columns is None else max(1, min(columns, n))
        rows = n_chunks if rows is None else max(1, min(rows, n_chunks))
        col = [i * columns // n for i in range(n)] if columns < n else range(n)
        row_of = [c * rows // n_chunks for c in range(n_chunks)]
        base = [TIER_HOST] * rows
        for c, where in enumerate(self.placement):
            if where == "device":
                base[row_of[c]] = TIER_DEVICE
        strip = [bytearray([b]) * columns for b in base]

        def paint(code: int, c: int, first: int, last: int) -> None:
            if self.placement[c] != "device":        # a device chunk's compute copy never leaves the device
                a, b = col[first], col[last] + 1
                strip[row_of[c]][a:b] = bytes([code]) * (b - a)

        per_chunk: dict[int, dict[str, list[int]]] = {}
        for kind, events in (("prefetch", self.prefetch_at), ("fetch", self.fetch_at),
                             ("release", self.release_at), ("offload", self.offload_at)):
            for i, c in events:
                per_chunk.setdefault(c, {"prefetch": [], "fetch": [], "release": [], "offload": []})[kind].append(i)
        moving = []
        for c, ev in per_chunk.items():
            for start, end in zip(ev["fetch"], ev["release"]):    # a chunk's residencies do not overlap
                paint(TIER_COPY_ON_DEVICE, c, start, end)
            fetches, j, prefetched = ev["fetch"], 0, set()
            for issued in ev["prefetch"]:                  # crossing from its prefetch to the fetch that waits
                while j < len(fetches) and fetches[j] < issued:
                    j += 1
                if j < len(fetches):
                    moving.append((c, issued, max(issued, fetches[j] - 1)))
                    prefetched.add(j)
                    j += 1
            moving += [(c, i, i) for k, i in enumerate(fetches) if k not in prefetched]   # loaded at its fetch
            moving += [(c, i, i) for i in ev["offload"]]
        for c, first, last in moving:            # painted last: a move wins over residency in a shared cell
            paint(TIER_MOVING, c, first, last)
        return strip


def timeline_of(plan) -> Timeline:
    """The plan along the step: bytes per tier, chunk moves and each chunk's tier, node by node."""
    prof = plan.profile
    if prof is None:
        raise ValueError("this Plan has no node profile (it was not made by make_plan)")
    index = {name: i for i, name in enumerate(prof.node_names)}
    events: dict[str, list[tuple[int, int]]] = {"prefetch": [], "fetch": [], "release": []}
    for ops_at in (plan.schedule_before, plan.schedule_after):
        for name, ops in ops_at.items():
            for op, c in ops:
                events[op].append((index[name], c))
    updates = sorted((i, c) for c, i in prof.update_at.items())
    fixed_bytes = plan.device_peak_bytes - plan.activation_peak_bytes   # allocated once, before the step
    return Timeline(
        node_names=prof.node_names,
        device_bytes=[fixed_bytes + a for a in prof.activation_bytes], device_fixed_bytes=fixed_bytes,
        host_bytes=[plan.host_peak_bytes] * len(prof.node_names),
        device_budget_bytes=plan.budget_bytes, host_budget_bytes=plan.host_budget_bytes,
        backward_start=prof.backward_start, placement=list(plan.placement),
        prefetch_at=sorted(events["prefetch"]), fetch_at=sorted(events["fetch"]),
        release_at=sorted(events["release"]), update_at=updates,
        offload_at=[(i, c) for i, c in updates if plan.placement[c] == "host"],
        chunk_elems=prof.chunk_elems, param_elems=prof.param_elems)
