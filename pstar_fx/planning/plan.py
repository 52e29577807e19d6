"""plan: a memory model of the step, a placement of chunks on tiers, and a schedule of chunk moves.

Input: the graph after `fuse_optimizer` (so chunk reads, gradient writes and updates are all nodes), the
Layout and the Config. Output: a `Plan` with

  placement   chunk -> "device" | "host": where its fp32 master, exp_avg and exp_avg_sq live;
  slots       compute buffers on the device (one chunk each) for chunks whose compute copy is not the
              master itself (host-resident chunks, and every chunk when dtype is 16-bit);
  grad_slots  gradient buffers on the device, enough for the chunks whose backward overlaps;
  host_grad_buffers  pinned host buffers where gradients of host chunks wait for the host Adam: enough
              that backward never waits for it (simulated with the cost model), as host memory allows;
  schedule    per node: which chunks to prefetch / fetch before it and release after it (schedule.py:
              Belady eviction, prefetch timed by the cost model of costs.py);
  peaks       predicted device and host bytes, from fake-tensor sizes of every value the graph holds;
  timeline()  all of it node by node, as plain lists (what `pstar_fx.plot` draws).

The memory model counts what the runtime counts: chunk memory allocated once at start, buffers, and the
live values of the graph (inputs, activations kept for backward, temporaries), each from the moment it is
produced to its last use. Views cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from ..config import Config, format_bytes
from .costs import Rates, calibrate, node_seconds
from .liveness import activation_profile
from ..fxutil import aliases_input, is_random, role_nodes, value_bytes
from ..kernels import quant8
from ..layout import Layout
from .schedule import Schedule, belady, place_prefetches

MASTER_STATE_BYTES = 12   # fp32 master + exp_avg + exp_avg_sq, per element (Config.state_bytes_per_param: 8 with bf16,
#                           6.03 with int8)
CUDA_BLOCK_BYTES = 512    # the CUDA caching allocator rounds every allocation up to this
CUDA_STEP_SLACK_BYTES = 2 * 2**20   # a step's small allocations outside the graph: norm partials, flags, checks
# Kernels that allocate more than their output's shape says (CPU mse_loss returns its 0-d loss on a
# batch-sized buffer: 28 bytes over the plan of a tiny BatchNorm model)
CPU_STEP_SLACK_BYTES = 4096
# Not counted in the peak (the allocator's allocated bytes) but kept free of the budget: what the caching
# allocator's segments lose to fragmentation, and what the CUDA context grows by after compile (kernel modules
# load at first use; the budget is the free memory read at compile). An 18B plan within 0.3 GiB of the GPU's
# free memory ran out; a 10B plan 224 MiB under it ran out in its first step with 0.74 GiB of the process's
# GPU memory outside PyTorch's allocator (2026-12-01).
CUDA_FRAGMENTATION_RESERVE_BYTES = 768 * 2**20


def usable_budget(budget: int | None, cuda: bool) -> int | None:
    """The device budget the plan may fill: on CUDA less a reserve for fragmentation (1/64 of a small one)."""
    if budget is None or not cuda:
        return budget
    return budget - min(CUDA_FRAGMENTATION_RESERVE_BYTES, budget // 64)
CUDA_HOST_OVERHEAD_BYTES = 4 * 2**30  # host memory of a CUDA process besides chunks: context, libraries, Python


class BudgetError(MemoryError):
    """The step cannot fit the memory budget; raised at compile/plan time, before any step runs."""


@dataclass
class Plan:
    placement: list[str]
    slots: int
    grad_slots: int
    host_grad_buffers: int
    schedule_before: dict[str, list[tuple[str, int]]]
    schedule_after: dict[str, list[tuple[str, int]]]
    device_peak_bytes: int
    host_peak_bytes: int
    device_breakdown: dict[str, int]
    host_breakdown: dict[str, int]
    activation_peak_bytes: int
    fetches: int = 0
    budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    why: str = ""                      # empty when it fits; else what is missing and what was tried
    recompute: str = ""                # which forward segments backward recomputes, and why
    estimated_step_seconds: float = 0.0  # from the cost model (costs.py); compares plans, not a promise
    rates: Rates | None = None         # the copy/compute/host-Adam rates the estimates used (costs.py)
    optimizer_state: str = "fp32"      # the moments' dtype (Config.optimizer_state)
    state_bytes_per_param: float = MASTER_STATE_BYTES   # chunk state per element: master + moments (+ int8 scales)
    transaction: str = "none"          # how a step stays provisional until it commits (runtime/step.py)
    replayable: bool = True            # no unseeded random op: a step run again computes the same gradients
    two_passes: bool = False           # "two_pass" that measures first: something to measure, or no replay
    transaction_cost: str = ""         # what that costs, and how much smaller it makes the largest model
    kept_on_device: bool = False       # kept_grads: device chunks keep their gradients on the device (room left)
    kept_in_shadow: bool = False       # deferred: a host chunk's gradient is kept in its 16-bit shadow (see plan())
    ship: list[str] = field(default_factory=list)  # per chunk, how its compute copy reaches the device:
    # "-" (state on the device), "shadow" (a 16-bit copy kept on the host, written by the host Adam in the
    # same pass: 2 B/param cross), "cast" (cast on the host at fetch: 2 B/param), "fp32" (4 B/param cross,
    # cast on the device)
    profile: NodeProfile | None = field(default=None, repr=False)  # what the planner knew node by node
    n_device: int = 0                  # chunks on the device among those a rank owns (all chunks on one rank)
    world: int = 1                     # data-parallel ranks the chunks are partitioned over (1: none)
    rank: int = 0                      # whose plan this is: chunks another rank owns are "remote"

    def owner(self, c: int) -> int:
        """The rank that holds chunk c's state and updates it."""
        return c % self.world

    @property
    def fits(self) -> bool:
        return not self.why

    def summary(self) -> str:
        lines = ["plan:"]
        lines.append(f"  device peak {format_bytes(self.device_peak_bytes)}"
                     + (f" of budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "")
                     + ": " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.device_breakdown.items()))
        lines.append(f"  host peak {format_bytes(self.host_peak_bytes)}: "
                     + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host_breakdown.items()))
        n_dev, n_host = self.placement.count("device"), self.placement.count("host")
        lines.append(f"  placement: {n_dev} chunk(s) on device, {n_host} on host"
                     + (f", {len(self.placement) - n_dev - n_host} owned by the other {self.world - 1} rank(s) "
                        f"(rank {self.rank} of {self.world}; chunk c is owned by rank c % {self.world})"
                        if self.world > 1 else "") + ": " + _ranges(self.placement))
        crossing = {k: self.ship.count(k) for k in ("shadow", "cast", "fp32") if k in self.ship}
        if crossing:
            lines.append("  host chunks reach the device as: " + ", ".join(f"{k} {v}" for k, v in crossing.items())
                         + " (shadow: 16-bit host copy written by the host Adam; fp32: cast on the device)")
        lines.append(f"  {self.slots} compute slot(s), {self.grad_slots} gradient slot(s), "
                     f"{self.host_grad_buffers} host gradient buffer(s); "
                     f"{self.fetches} chunk fetch(es) per step; estimated step {self.estimated_step_seconds:.3g} s")
        if self.recompute:
            lines.append(f"  recompute: {self.recompute}")
        lines.append(f"  chunk state: {self.state_bytes_per_param:.3g} B/param (fp32 master + {self.optimizer_state} "
                     "exp_avg and exp_avg_sq" + (", an fp32 scale per 256 elements each" if self.optimizer_state
                                                 == "int8" else "") + ")")
        lines.append(f"  step transaction: {self.transaction}" + (f" ({self.transaction_cost})"
                                                                 if self.transaction_cost else ""))
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("  fits" if self.fits else f"  DOES NOT FIT: {self.why}")
        return "\n".join(lines)

    def timeline(self) -> Timeline:
        """The plan along the step: bytes per tier, chunk moves and each chunk's tier, node by node."""
        prof = self.profile
        if prof is None:
            raise ValueError("this Plan has no node profile (it was not made by make_plan)")
        index = {name: i for i, name in enumerate(prof.node_names)}
        events: dict[str, list[tuple[int, int]]] = {"prefetch": [], "fetch": [], "release": []}
        for ops_at in (self.schedule_before, self.schedule_after):
            for name, ops in ops_at.items():
                for op, c in ops:
                    events[op].append((index[name], c))
        updates = sorted((i, c) for c, i in prof.update_at.items())
        fixed = self.device_peak_bytes - self.activation_peak_bytes   # allocated once, before the step
        return Timeline(
            node_names=prof.node_names,
            device_bytes=[fixed + a for a in prof.activation_bytes], device_fixed_bytes=fixed,
            host_bytes=[self.host_peak_bytes] * len(prof.node_names),
            device_budget_bytes=self.budget_bytes, host_budget_bytes=self.host_budget_bytes,
            backward_start=prof.backward_start, placement=list(self.placement),
            prefetch_at=sorted(events["prefetch"]), fetch_at=sorted(events["fetch"]),
            release_at=sorted(events["release"]), update_at=updates,
            offload_at=[(i, c) for i, c in updates if self.placement[c] == "host"],
            chunk_elems=prof.chunk_elems, param_elems=prof.param_elems)


@dataclass
class NodeProfile:
    """What make_plan knew node by node (one list of ints and the graph's names: cheap at 10k nodes)."""
    node_names: list[str]           # the planned graph in order (engine.graph without its chunk moves)
    activation_bytes: list[int]     # live graph values while each node runs (activation_profile)
    backward_start: int             # first node reading the tangent; len(node_names) for a forward-only step
    update_at: dict[int, int]       # chunk -> index of its rt.adam(c) node
    chunk_elems: int
    param_elems: int


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


@dataclass(frozen=True)
class PlanDelta:
    """What a stage after the planner learned that the plan must count: a pass that holds more graph values
    than the planned graph did (compile_regions), or the recompute search's account of what it chose. The planner
    folds it in (`fold`); nobody else writes a Plan."""
    activation_bytes: int = 0          # more live bytes at the activation peak (device)
    notes: tuple[str, ...] = ()        # appended to the plan's notes
    recompute: str | None = None       # replaces the plan's recompute text
    why: str = ""                      # appended to why the plan does not fit (only when it does not)


def fold(plan: Plan, delta: PlanDelta) -> Plan:
    """The plan with `delta` counted: its activation peak, its device peak and breakdown move together, so the
    summary still adds up. Returns a new Plan; `plan` is unchanged."""
    device = dict(plan.device_breakdown)
    if delta.activation_bytes:
        device["activations"] = device.get("activations", 0) + delta.activation_bytes
    return replace(plan, device_breakdown=device,
                   activation_peak_bytes=plan.activation_peak_bytes + delta.activation_bytes,
                   device_peak_bytes=plan.device_peak_bytes + delta.activation_bytes,
                   notes=[*plan.notes, *delta.notes],
                   recompute=plan.recompute if delta.recompute is None else delta.recompute,
                   why=plan.why + (f"; {delta.why}" if delta.why and plan.why else ""))


def _ranges(placement: list[str]) -> str:
    out, start = [], 0
    for i in range(1, len(placement) + 1):
        if i == len(placement) or placement[i] != placement[start]:
            out.append(f"c{start}" + (f"-c{i - 1}" if i - 1 > start else "") + f"={placement[start]}")
            start = i
    return " ".join(out)


# ---------------------------------------------------------------------------------------------------------
# placement and schedule

def make_plan(gm: fx.GraphModule, layout: Layout, config: Config, *, compute_itemsize: int,
              buffer_bytes: int, on: Plan | None = None, world: int = 1, rank: int = 0,
              rates: Rates | None = None) -> Plan:
    """Placement and schedule for the fused graph under the config's budgets. Never raises for memory:
    a plan that does not fit says so (`fits`, `why`); compile() turns that into a BudgetError.
    `on`: schedule this graph on another plan's chunk memory (its placement, shipping and compute slots),
    as evaluation does on the training step's.

    `world` > 1: chunk-partitioned data parallelism. Chunk c is owned by rank c % world, which alone holds
    its state; the others' chunks are "remote" in this rank's placement. The schedule is a collective
    contract (every rank broadcasts and reduces the same chunks in the same order), so everything that
    shapes it is planned for rank 0, which owns the most chunks (ceil(n / world)), and applied to every
    rank by the chunk's index among its owner's chunks: the k-th chunk a rank owns sits on the same tier
    on every rank. `rates` must then be the same on every rank (the engine broadcasts rank 0's). A rank that
    owns fewer chunks than rank 0 is planned like it: its peaks are an upper bound of what it allocates."""
    g = gm.graph
    nodes = list(g.nodes)
    param_nodes = role_nodes(g, "param")
    param_chunk = {p: layout.slots[i].chunk for i, p in enumerate(param_nodes)}
    n_chunks = len(layout.chunks)
    cs = layout.chunk_size
    fp32 = compute_itemsize == 4
    chunked = world > 1
    owner = [c % world for c in range(n_chunks)]
    n_own = len(range(0, n_chunks, world))   # rank 0's chunks: the most any rank owns

    # what each node needs resident, and where gradient buffers live
    reads: list[set[int]] = []
    grad_first: dict[int, int] = {}
    adam_at: dict[int, int] = {}
    via: dict[fx.Node, set[int]] = {p: {c} for p, c in param_chunk.items()}  # views of chunk memory
    for i, node in enumerate(nodes):
        r = set().union(*(via[a] for a in node.all_input_nodes if a in via))
        reads.append(r)
        if r and aliases_input(node):
            via[node] = r   # a view keeps its chunk needed until its own last reader
        if node.op == "call_method" and node.target == "grad":
            grad_first.setdefault(layout.slots[node.args[1]].chunk, i)
        elif node.op == "call_method" and node.target == "adam":
            adam_at[node.args[1]] = i
    grad_slots = _max_overlap([(grad_first[c], adam_at[c]) for c in grad_first if c in adam_at])
    if chunked and grad_slots:
        grad_slots += 1    # a chunk's update waits for its reduce until the next chunk's gradient is done

    buffer_nodes = role_nodes(g, "buffer")
    cuda = config.device.startswith("cuda")
    act_per_node, act_peak = activation_profile(g, skip=set(param_nodes) | set(buffer_nodes) | set(role_nodes(g, "rt")),
                                                round_to=CUDA_BLOCK_BYTES if cuda else 1, cuda=cuda)
    slot_bytes = cs * compute_itemsize
    grad_slot_bytes = cs * compute_itemsize
    accum_bytes = cs * 4 if config.grad_accum > 1 else 0       # fp32 gradient accumulators, on each tier
    # int8 moments: their block scales, as many as the chunk with the most blocks (each parameter's own) needs
    scale_blocks = max((quant8.blocks_of(ch.param_spans()) for ch in layout.chunks), default=0)
    state_bytes = config.chunk_state_bytes(cs, scale_blocks) + accum_bytes
    n_updated = sum(1 for c, ch in enumerate(layout.chunks) if ch.grad_spans() and owner[c] == 0)
    min_slots = max((len(r) for r in reads), default=0)
    # the libraries' workspaces (cuBLAS keeps one per handle for the process's life), measured with the rates
    rates = rates or calibrate(torch.device(config.device), config.torch_dtype)
    workspace = rates.workspace_bytes + CUDA_STEP_SLACK_BYTES if cuda else CPU_STEP_SLACK_BYTES
    staging = cs * 4 if (cuda and not fp32) else 0      # (when any chunk is on the host)
    # an accumulating step holds its whole batch (grad_accum micro-batches) while the graph sees one
    batch_rest = (config.grad_accum - 1) * sum(value_bytes(n.meta.get("val"), CUDA_BLOCK_BYTES if cuda else 1)
                                               for n in role_nodes(g, "input"))
    fixed = act_peak + buffer_bytes + grad_slots * grad_slot_bytes + workspace + batch_rest
    budget = usable_budget(config.device_memory, cuda)
    notes: list[str] = []
    # with any chunk on the host: CUDA keeps at least 2 gradient buffers (it never casts on the host);
    # the CPU runtime 1 gradient buffer and 1 cast staging buffer. Kept gradients need no gradient buffer (each
    # lands in its own): then only the CPU runtime's cast staging (16-bit compute) is held back
    overhead = CUDA_HOST_OVERHEAD_BYTES if cuda else 0
    kept_staging = 0 if cuda or compute_itemsize == 4 else cs * compute_itemsize
    host_staging = 2 * cs * compute_itemsize + overhead
    host_room = (None if config.host_memory is None
                 else max(0, (config.host_memory - host_staging) // state_bytes))

    # placement: as many chunks' state on the device as the budget allows, keeping `min_slots` slots;
    # the rest on the host, which must hold them. Counted in chunks this rank owns (all of them on one rank)
    def device_fits(k: int) -> bool:
        # with chunks on the host (or owned by other ranks), one slot more than an op reads lets the next
        # copy overlap compute
        local = fp32 and k == n_own and not chunked
        need_slots = 0 if local else min_slots + (k < n_own or chunked)
        extra = staging if k < n_own else 0
        return budget is None or fixed + extra + k * state_bytes + need_slots * slot_bytes <= budget

    def place() -> int:
        if config.placement == "host":
            n = 0
        elif config.placement == "device" or budget is None:
            n = n_own
        else:
            n = next((k for k in range(n_own, -1, -1) if device_fits(k)), 0)
        if host_room is not None and n_own - n > host_room and config.placement != "host":
            n = min(n_own, n_own - host_room)   # the host is full: more state must sit on the device
        return n

    n_device = place()
    random_ops = [n.name for n in nodes if n.op == "call_function" and is_random(n)]
    host_free = (None if config.host_memory is None       # for kept gradients
                 else config.host_memory - overhead - kept_staging - (n_own - n_device) * state_bytes)
    transaction, kept_bytes = _choose_transaction(config, n_updated * cs * compute_itemsize, host_free=host_free,
                                                  random_ops=random_ops)
    if transaction in KEEPS and cuda and n_device and grad_slots < 2 and on is None:
        # a device chunk's kept gradient is copied to the host from its slot: a second slot lets backward go
        # on meanwhile (GPT3_10B with one slot: the compute stream waited 0.14 s a step for those copies)
        grad_slots = 2
        fixed += grad_slot_bytes
        n_device = place()
    if on is not None:
        n_device = on.n_device
    # the tier of chunk c at its owner: the first n_device chunks an owner holds are on its device
    tier_of = ["device" if c // world < n_device else "host" for c in range(n_chunks)]
    placement = [tier_of[c] if owner[c] == rank else "remote" for c in range(n_chunks)]
    planned = [tier_of[c] if owner[c] == 0 else "remote" for c in range(n_chunks)]   # rank 0's: the largest
    n_updated_device = sum(1 for c, ch in enumerate(layout.chunks) if ch.grad_spans() and planned[c] == "device")
    needs_slot = [chunked or not (fp32 and tier_of[c] == "device") for c in range(n_chunks)]
    slot_chunks = sum(needs_slot)
    if slot_chunks:
        extra = staging if n_device < n_own else 0
        spare = ((budget - fixed - extra - n_device * state_bytes) // slot_bytes
                 if budget is not None else slot_chunks)
        slots = max(min_slots, min(slot_chunks, spare))
        if slots < slot_chunks:
            notes.append(f"{slots} compute slots for {slot_chunks} chunks: Belady eviction refetches the rest")
    else:
        slots = 0
    if on is not None:
        slots = on.slots

    node_secs = [node_seconds(n, rates) for n in nodes]
    host_used = (n_own - n_device) * state_bytes + host_staging
    room = None if config.host_memory is None else (config.host_memory - host_used) // (cs * compute_itemsize)
    # a deferred step's host Adam runs after the verdict: timed below (_after_verdict_exposed), once the copies'
    # times and where the kept gradients live are known; it keeps every gradient in its own buffer (no pool)
    after_verdict = transaction == "deferred" and cuda and bool(kept_bytes)
    host_grad_buffers, adam_exposed = (0, 0.0) if after_verdict else _host_adam_pipeline(
        planned, layout, node_secs, reads, adam_at, rates.host_adam_with(config.optimizer_state), cuda, room)
    if kept_bytes:                     # every host chunk's gradient lands in its own kept buffer: no pool
        host_grad_buffers = 0
        host_used = (n_own - n_device) * state_bytes + overhead + kept_staging + kept_bytes
    else:
        host_used += max(0, host_grad_buffers - 2) * cs * compute_itemsize
    # how each chunk's compute copy reaches its owner's device: the k-th host chunk of every owner alike.
    # Deferred, 16-bit: a host chunk's kept gradient and its shadow are never needed at once (the gradient lands
    # after backward's last read of the shadow, and the host Adam reads it where it writes the new 16-bit
    # weights, element by element), so one buffer is both and every host chunk crosses in 16 bits for the
    # kept gradient's bytes alone
    host_ids = [c for c in range(n_chunks) if tier_of[c] == "host" and owner[c] == rank]
    kept_in_shadow = (transaction == "deferred" and not fp32 and on is None and world == 1 and bool(host_ids)
                      and all(layout.chunks[c].grad_spans() for c in host_ids))
    host_ship = (["shadow"] * (n_own - n_device) if kept_in_shadow else
                 _choose_shipping(n_own - n_device, config, cs, compute_itemsize, cuda, host_used=host_used))
    ship_of = ["-" if tier_of[c] == "device" else host_ship[c // world - n_device] for c in range(n_chunks)]
    ship = [ship_of[c] if owner[c] == rank else "remote" for c in range(n_chunks)]
    if on is not None:
        ship = list(on.ship)
    slot_reads = [{c for c in r if needs_slot[c]} for r in reads]
    crossing = {"-": 0, "shadow": compute_itemsize, "cast": compute_itemsize, "fp32": 4}
    copy_bytes = {c: cs * crossing[ship_of[c]] for c in range(n_chunks)}
    # a chunk's compute copy: onto its owner's device, then (chunked) broadcast from there to every rank
    # (a ring broadcast or reduce moves the whole buffer through every link: its time is bytes / bus bandwidth)
    coll_seconds = cs * compute_itemsize / rates.coll_bw if chunked else 0.0
    copy_seconds = {c: b / rates.h2d_bw + cs * (4 + compute_itemsize) / rates.mem_bw + coll_seconds
                    for c, b in copy_bytes.items()}
    sched = place_prefetches(belady(slot_reads, slots), slots, node_secs, copy_seconds) if slots else Schedule()
    before = {nodes[i].name: ops for i, ops in sched.before.items()}
    after = {nodes[i].name: ops for i, ops in sched.after.items()}
    fetches = sched.fetches
    if sched.exposed_seconds > 1e-4:
        notes.append(f"copies the compute cannot hide: about {sched.exposed_seconds * 1e3:.1f} ms per step "
                     f"(rates: {rates.device})")
    device = {
        "activations": act_peak,
        "buffers": buffer_bytes,
        "chunk state": n_device * state_bytes,
        "compute slots": slots * slot_bytes,
        "gradient slots": grad_slots * grad_slot_bytes,
    }
    if workspace:
        device["workspace margin"] = workspace
    if batch_rest:
        device["other micro-batches"] = batch_rest
    n_host = n_own - n_device
    if not fp32 and "fp32" in host_ship:
        device["copy staging"] = cs * 4   # chunks shipped in fp32 are cast on the device
    host = {
        "process overhead": CUDA_HOST_OVERHEAD_BYTES if cuda else 0,
        "chunk state": n_host * state_bytes,
        # (kept in a shadow, a host chunk's gradient is counted once, as a kept gradient)
        "16-bit shadows": 0 if kept_in_shadow else host_ship.count("shadow") * cs * compute_itemsize,
        # gradients of host chunks queue here for the host Adam (CUDA: while backward goes on)
        "gradient staging": cs * compute_itemsize * host_grad_buffers,
        "cast staging": (cs * compute_itemsize) if "cast" in host_ship else 0,
        "kept gradients": kept_bytes,
    }
    if accum_bytes:
        device["gradient accumulators"] = n_device * accum_bytes
        device["chunk state"] -= n_device * accum_bytes
        host["gradient accumulators"] = n_host * accum_bytes
        host["chunk state"] -= n_host * accum_bytes
    plan = Plan(placement, slots, grad_slots, host_grad_buffers, before, after,
                device_peak_bytes=sum(device.values()), host_peak_bytes=sum(host.values()),
                device_breakdown=device, host_breakdown=host, activation_peak_bytes=act_peak,
                fetches=fetches, budget_bytes=config.device_memory, host_budget_bytes=config.host_memory, notes=notes,
                ship=ship, rates=rates, n_device=n_device, world=world, rank=rank, kept_in_shadow=kept_in_shadow)
    tangent_users = {u for t in role_nodes(g, "tangent") for u in t.users}    # backward's first ops
    plan.profile = NodeProfile([n.name for n in nodes], act_per_node,
                               next((i for i, n in enumerate(nodes) if n in tangent_users), len(nodes)),
                               adam_at, chunk_elems=cs, param_elems=layout.param_elems)
    if keeps_compute_copies(plan, config.torch_dtype):
        notes.append("every chunk has a compute slot for good: a device chunk's 16-bit compute copy stays from step "
                     "to step, written by its update, not cast from the master at each fetch")
    if cuda:
        notes.append(f"CUDA memory model: each value rounded up to {CUDA_BLOCK_BYTES} B (the caching allocator's "
                     f"block), plus {format_bytes(workspace)} for cuBLAS workspaces (measured) and the step's small "
                     "allocations outside the graph"
                     + (f"; the peak is kept {format_bytes(config.device_memory - budget)} under the budget for the "
                        "allocator's fragmentation" if budget is not None else ""))
    device_kept = n_updated_device * cs * compute_itemsize if transaction in KEEPS else 0
    if device_kept and (budget is None or plan.device_peak_bytes + device_kept <= budget):
        plan.kept_on_device = True       # spare device memory: no copies out, and an undo needs none back
        device["kept gradients"] = device_kept
        host["kept gradients"] -= device_kept
        kept_bytes -= device_kept
        plan.device_peak_bytes += device_kept
        plan.host_peak_bytes -= device_kept
    plan.why = _why(plan, config, min_slots, budget)
    if after_verdict:
        # every update waits for the verdict: the host Adam runs into the next forward, not inside backward
        back_s = 0.0 if plan.kept_on_device else n_updated_device * cs * compute_itemsize / rates.h2d_bw
        adam_exposed = _after_verdict_exposed(planned, layout, node_secs, reads, adam_at,
                                              rates.host_adam_with(config.optimizer_state), copy_seconds, back_s)
    # step time = compute (recompute included) + copies not hidden + host Adam that compute can't hide
    plan.estimated_step_seconds = sum(node_secs) + sched.exposed_seconds + adam_exposed
    if chunked:
        # every broadcast and reduce runs on one collective stream, in graph order: the step takes at least
        # their sum. The broadcasts' wait is in the schedule's exposed time; the reduces overlap backward.
        n_reduced = sum(1 for ch in layout.chunks if ch.grad_spans())
        comm = (fetches + n_reduced) * coll_seconds           # per micro-batch, like the estimate itself
        plan.estimated_step_seconds = max(plan.estimated_step_seconds, comm)
        notes.append(f"data parallel over {world} ranks, chunks partitioned: {fetches} chunk broadcast(s) and "
                     f"{n_reduced} reduce(s) per micro-batch, {format_bytes(cs * compute_itemsize)} each, about "
                     f"{comm * 1e3:.1f} ms per micro-batch at a bus bandwidth of {rates.coll_bw / 1e9:.0f} GB/s")
    plan.transaction, plan.replayable = transaction, not random_ops
    plan.optimizer_state, plan.state_bytes_per_param = config.optimizer_state, config.state_bytes_per_param
    # "two_pass" with nothing to measure runs one pass that rolls back as a replay; a step that cannot be replayed
    # (unseeded random ops) measures first all the same, so a skipped step still changes nothing
    two_passes = plan.two_passes = transaction == "two_pass" and (config.verdict_changes_updates or bool(random_ops))
    if two_passes:
        plan.estimated_step_seconds += sum(node_secs)
    kept_copy_s = 0.0 if plan.kept_on_device else n_updated_device * cs * compute_itemsize / rates.d2h_bw
    plan.transaction_cost = _transaction_cost(transaction, config, compute_itemsize, kept_bytes, accum_bytes,
                                              n_device, n_own - n_device, host_ship,
                                              sum(node_secs) if two_passes else 0.0, kept_copy_s, plan.kept_on_device,
                                              plan.kept_in_shadow)
    if adam_exposed > 1e-3:
        if after_verdict:
            why = ("every update after the verdict: the host Adam runs into the next forward, which waits where it "
                   "reads a host chunk not yet updated")
            if not plan.kept_on_device and n_updated_device:
                why += "; the device chunks' kept gradients come back from the host first"
        elif kept_bytes or plan.kept_on_device:
            why = "each host chunk's gradient in its own kept buffer"
        else:
            why = f"{host_grad_buffers} host gradient buffers"
        notes.append(f"host Adam the compute cannot hide: about {adam_exposed * 1e3:.0f} ms per step ({why})")
    return plan


def _host_adam_pipeline(placement: list[str], layout: Layout, node_secs: list[float], reads: list[set[int]],
                        adam_at: dict[int, int], host_adam: float, cuda: bool, room: int | None,
                        most: int = 32) -> tuple[int, float]:
    """(host gradient buffers, seconds of host Adam the step cannot hide), by simulating the pipeline; `host_adam`:
    the host Adam's parameters/s with the configured moments.

    Backward hands each host chunk's gradient to one worker that runs the host Adam chunk after chunk.
    A gradient waits in a host buffer until its Adam is done; with every buffer taken, the thread that
    launches GPU work blocks, and the GPU runs dry. The Adam still running when the step ends overlaps
    the next step's forward up to the first read of a host chunk. The smallest buffer count that never
    blocks (within `room` more than the 2 always counted, at most `most`) is chosen; the CPU runtime is
    synchronous and uses one.
    """
    host = [c for c in sorted(adam_at, key=adam_at.__getitem__) if placement[c] == "host"]
    if not host:
        return (1 if "host" in placement else 0), 0.0
    if not cuda:
        return 1, sum(layout.chunks[c].used_elems for c in host) / host_adam
    clock, t = [], 0.0
    for s in node_secs:
        t += s
        clock.append(t)
    first_host_read = next((clock[i] - node_secs[i] for i, r in enumerate(reads)
                            if any(placement[c] == "host" for c in r)), 0.0)
    adam_s = [layout.chunks[c].used_elems / host_adam for c in host]

    def simulate(k: int) -> float:
        delay, done = 0.0, []
        for i, c in enumerate(host):
            ready = clock[adam_at[c]] + delay
            if i >= k and done[i - k] > ready:       # every buffer holds a gradient Adam has not read
                delay += done[i - k] - ready
                ready = done[i - k]
            done.append(max(ready, done[-1] if done else 0.0) + adam_s[i])
        tail = done[-1] - (clock[-1] + delay)          # Adam left when the step's compute ends
        return delay + max(0.0, tail - first_host_read)

    cap = most if room is None else max(2, min(most, 2 + room))
    best = min(range(2, cap + 1), key=lambda k: (round(simulate(k), 3), k))
    return best, simulate(best)


def _after_verdict_exposed(placement: list[str], layout: Layout, node_secs: list[float], reads: list[set[int]],
                           adam_at: dict[int, int], host_adam: float, copy_s: dict[int, float],
                           back_s: float) -> float:
    """Seconds a deferred step adds to the compute for updates that run after the verdict.

    The verdict ends the step. The device chunks' kept gradients that wait on the host come back first, on the
    compute stream (`back_s`), with their updates; the next forward starts after them. Meanwhile the worker runs
    the host Adam chunk after chunk, in chunk order, from the verdict on; a host chunk's compute copy crosses
    (`copy_s[c]`: the schedule's copy seconds) once its update is done, and the forward stalls where it would
    read a chunk before that. A stall delays every later read alike, so the step grows by the latest chunk's
    lateness (at least `back_s`).
    """
    host = sorted(c for c in adam_at if placement[c] == "host")
    t, first_read = 0.0, {}
    for i, r in enumerate(reads):
        for c in r:
            first_read.setdefault(c, t)
        t += node_secs[i]
    done, exposed = 0.0, back_s
    for c in host:
        done += layout.chunks[c].used_elems / host_adam
        exposed = max(exposed, done + copy_s[c] - first_read.get(c, t))
    return exposed


def _choose_shipping(n_host: int, config: Config, cs: int, itemsize: int, cuda: bool, host_used: int) -> list[str]:
    """How the compute copy of an owner's k-th host chunk (k < n_host) crosses to the device.

    fp32 compute: the master itself crosses (4 B/param). 16-bit: a host-side 16-bit shadow, written by the
    host Adam in the same pass that updates the master (no extra read), halves the bytes that cross, so
    every host chunk gets one while host memory lasts. Without room, the CUDA runtime ships fp32 and
    casts on the device (a cast on the host would stall the thread that launches GPU work), and the
    CPU runtime casts on the host into a staging buffer.
    """
    if itemsize == 4:
        return ["fp32"] * n_host
    spare = float("inf") if config.host_memory is None else config.host_memory - host_used
    shadows = n_host if spare == float("inf") else max(0, min(n_host, int(spare // (cs * itemsize))))
    return ["shadow"] * shadows + ["fp32" if cuda else "cast"] * (n_host - shadows)


KEEPS = ("kept_grads", "deferred")   # the transactions that keep every chunk's gradient until the verdict


def _choose_transaction(config: Config, kept_total: int, host_free: int | None,
                        random_ops: list[str]) -> tuple[str, int]:
    """(transaction, host bytes of kept gradients). See Config.transaction for the choices. A step with random
    ops the seed_random pass did not seed (`random_ops`; normally none) cannot be replayed faithfully."""
    if config.grad_accum > 1:
        return "accumulate", 0        # the accumulators keep the step's gradients; updates run after the verdict
    choice = config.transaction
    if choice == "replay" and random_ops:
        raise ValueError(f"transaction 'replay' runs a step again, but this step draws random numbers "
                         f"({', '.join(random_ops[:3])}{', ...' if len(random_ops) > 3 else ''}): a replay would "
                         "draw others; use 'kept_grads' or 'two_pass'")
    fits = host_free is None or kept_total <= host_free
    if choice == "auto" and not config.moments_undoable:
        # bf16 and int8 moments cannot be undone: keep the gradients and apply after the verdict, or measure first
        choice = "deferred" if fits else "two_pass"
    if choice == "auto":
        choice = "kept_grads" if fits else "two_pass" if random_ops else "replay"
    return choice, kept_total if choice in KEEPS else 0


def _transaction_cost(transaction: str, config: Config, itemsize: int, kept_bytes: int, accum_bytes: int,
                      n_device: int, n_host: int, ship: list[str], second_pass_s: float, kept_copy_s: float,
                      kept_on_device: bool, kept_in_shadow: bool = False) -> str:
    """What the chosen transaction costs, and how much smaller the largest model is for it."""
    shadow = itemsize if "shadow" in ship else 0
    state = round(config.state_bytes_per_param, 2)
    host_base = round(state + shadow, 2)                      # bytes per parameter of a host chunk without it
    if transaction == "accumulate":
        return (f"gradients of {config.grad_accum} micro-batches summed in fp32 accumulators, 4 B/param on "
                f"each chunk's tier ({format_bytes(accum_bytes * (n_device + n_host))}); every update runs after "
                f"the verdict, exactly. Chunk state {state} -> {state + 4} B/param on "
                f"the device and {host_base} -> {host_base + 4} on the host: the largest model is about "
                f"{100 * 4 / (host_base + 4):.0f}% smaller")
    if transaction == "deferred":
        shadows = (", a host chunk's in its 16-bit shadow (free again before the host Adam writes the new weights "
                   "there)" if kept_in_shadow else "")
        return (f"each chunk's gradient kept until the verdict{shadows}, {itemsize} B/param "
                f"({format_bytes(kept_bytes)} on the host), nothing updated inside backward; every update is applied "
                "after the verdict from the kept gradients, exactly: no undo (what bf16 and int8 moments need), "
                "the host Adam runs after backward, into the next step's forward")
    if transaction == "kept_grads":
        where = ("device chunks' on the device (spare room)" if kept_on_device else
                 f"device chunks' copied to the host (about {kept_copy_s * 1e3:.0f} ms of device->host copies, "
                 "overlapped)")
        return (f"speculative updates inside backward; each chunk's gradient kept until the verdict, "
                f"{itemsize} B/param ({format_bytes(kept_bytes)} on the host), {where}; clipping that triggers "
                f"costs an undo + redo pass over every chunk; rollback within fp32 rounding. Host bytes per "
                f"parameter of a host-bound model {host_base} -> {host_base + itemsize}: the largest model is "
                f"about {100 * itemsize / (host_base + itemsize):.0f}% smaller")
    if transaction == "replay":
        return ("speculative updates inside backward, nothing kept (the host budget does not hold the "
                f"{itemsize} B/param of kept gradients); a step that must be corrected (clipping that "
                "triggers) or rolled back (a skip, an exception) restores the masters from the moments and runs "
                "forward and backward again: free when it does not trigger, about one more step when it does; "
                "a host Adam failure after the step returned cannot be undone")
    if transaction == "two_pass":
        if not second_pass_s:
            return ("nothing to measure first (no clipping, no loss scaling, fp32 moments): one pass, updates "
                    "inside backward; a non-finite gradient or an exception rolls the step back by restoring the "
                    "masters from the moments and running it again (as 'replay'); no memory")
        when = (f"on every step ({config.optimizer_state} moments cannot be undone)" if not config.moments_undoable
                else "when clipping or loss scaling is on" if config.verdict_changes_updates
                else "on every step (unseeded random ops: a step cannot be replayed)")
        return ("a first forward+backward measures the norm and updates nothing, the second applies exactly: "
                f"+{second_pass_s:.3g} s/step of compute {when}; no memory; "
                "an exception in the second pass leaves the chunks it updated")
    return ("updates applied as they come: an exception or a non-finite gradient leaves the chunks already "
            "updated (the host budget does not hold kept gradients)")


def _max_overlap(intervals: list[tuple[int, int]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e + 1, -1) for _, e in intervals])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def keeps_compute_copies(plan: Plan, compute_dtype: torch.dtype) -> bool:
    """Whether each device chunk keeps its 16-bit compute copy from step to step: the plan gave every chunk a
    compute slot (none is ever evicted), compute is 16-bit (fp32 device chunks compute on their masters), and
    one rank holds every chunk (partitioned ranks broadcast their compute copies each step). The device Adam
    then writes the copy as it updates the master (+2 B/param written) instead of each step's first fetch
    casting it (6 B/param moved, one launch per chunk)."""
    return compute_dtype.itemsize != 4 and plan.world == 1 and plan.slots >= len(plan.placement) > 0


def _why(plan: Plan, config: Config, min_slots: int, budget: int | None) -> str:
    """Empty when the plan fits; else what is missing, where the bytes go, and what was already tried.
    `budget`: the usable device budget (`usable_budget`)."""
    reasons = []
    host_budget = config.host_memory
    if budget is not None and plan.device_peak_bytes > budget:
        owned = len(plan.placement) - plan.placement.count("remote")
        tried = (f"{plan.placement.count('host')} of {owned} chunks' state on the host"
                 + (f" (the chunks rank {plan.rank} owns of {len(plan.placement)})" if plan.world > 1 else "") + ", "
                 f"the minimum of {min_slots} compute slot(s) (what one op reads at once)"
                 if config.placement != "device" else "placement='device' forces every chunk onto the device")
        reasons.append(
            f"the step needs {format_bytes(plan.device_peak_bytes)} of device memory but device_memory is "
            f"{format_bytes(config.device_memory)}"
            + (f" ({format_bytes(budget)} usable: the rest is kept for the allocator's fragmentation)"
               if budget != config.device_memory else "")
            + f" ({format_bytes(plan.device_peak_bytes - budget)} missing). Device bytes: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.device_breakdown.items())
            + f". Already tried: {tried}")
    if host_budget is not None and plan.host_peak_bytes > host_budget:
        reasons.append(
            f"the host tier needs {format_bytes(plan.host_peak_bytes)} but host_memory is "
            f"{format_bytes(host_budget)} ({format_bytes(plan.host_peak_bytes - host_budget)} missing): "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.host_breakdown.items()))
    return "; ".join(reasons)
