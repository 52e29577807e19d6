"""placement: how many chunks' state the device holds, and how many compute and gradient slots it keeps — as many
chunks on the device as the budget allows while keeping the slots one op needs; the rest on the host, which must
hold them. Counted in the chunks a rank owns: chunk c is owned by rank c % world, and the k-th chunk of every
rank sits on the same tier.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..config import Config
from ..fxutil import aliases_input
from ..layout import Layout
from .memory import StepBytes, _max_overlap


@dataclass(frozen=True)
class ChunkUse:
    """Which chunks each node of the fused graph needs, and where each chunk's gradient lives."""
    reads: list[set[int]]        # per node: the chunks it reads (through parameters and their views)
    grad_first: dict[int, int]   # chunk -> first node writing its gradient
    adam_at: dict[int, int]      # chunk -> its rt.adam(c) node

    @property
    def min_slots(self) -> int:
        """The compute slots one op needs at once."""
        return max((len(r) for r in self.reads), default=0)


def chunk_use(nodes: list[fx.Node], param_nodes: list[fx.Node], layout: Layout) -> ChunkUse:
    via: dict[fx.Node, set[int]] = {p: {layout.slots[i].chunk} for i, p in enumerate(param_nodes)}  # chunk views
    reads: list[set[int]] = []
    grad_first: dict[int, int] = {}
    adam_at: dict[int, int] = {}
    for i, node in enumerate(nodes):
        r = set().union(*(via[a] for a in node.all_input_nodes if a in via))
        reads.append(r)
        if r and aliases_input(node):
            via[node] = r   # a view keeps its chunk needed until its own last reader
        if node.op == "call_method" and node.target == "grad":
            grad_first.setdefault(layout.slots[node.args[1]].chunk, i)
        elif node.op == "call_method" and node.target == "adam":
            adam_at[node.args[1]] = i
    return ChunkUse(reads, grad_first, adam_at)


def n_grad_slots(use: ChunkUse, chunked: bool) -> int:
    """Gradient slots: enough for the chunks whose gradients are written at once (first write to update)."""
    n = _max_overlap([(use.grad_first[c], use.adam_at[c]) for c in use.grad_first if c in use.adam_at])
    if chunked and n:
        n += 1    # a chunk's update waits for its reduce until the next chunk's gradient is done
    return n


def n_device_chunks(sizes: StepBytes, config: Config, *, budget_bytes: int | None, fixed_bytes: int, n_own: int,
                    min_slots: int, fp32: bool, chunked: bool, host_room_chunks: int | None) -> int:
    """How many of the chunks a rank owns (`n_own`) hold their state on the device."""
    def device_fits(k: int) -> bool:
        # with chunks on the host (or owned by other ranks), one slot more than an op reads lets the next
        # copy overlap compute
        local = fp32 and k == n_own and not chunked
        need_slots = 0 if local else min_slots + (k < n_own or chunked)
        staging_bytes = sizes.device_staging_bytes if k < n_own else 0
        return (budget_bytes is None or fixed_bytes + staging_bytes + sizes.first_bytes(k)
                + need_slots * sizes.compute_chunk_bytes <= budget_bytes)

    if config.placement == "host":
        n = 0
    elif config.placement == "device" or budget_bytes is None:
        n = n_own
    else:
        n = next((k for k in range(n_own, -1, -1) if device_fits(k)), 0)
    if host_room_chunks is not None and n_own - n > host_room_chunks and config.placement != "host":
        n = min(n_own, n_own - host_room_chunks)   # the host is full: more state must sit on the device
    return n


def host_room_chunks(sizes: StepBytes, config: Config, n_own: int) -> int | None:
    """How many of the last chunks a rank owns (in device order) the host budget holds beside its staging buffers
    (None: unlimited). Chunks differ in size (a frozen chunk holds only its weights), so it is counted from the end."""
    if config.host_memory is None:
        return None
    room_bytes = config.host_memory - sizes.host_staging_bytes
    return next((m for m in range(n_own, 0, -1) if sizes.rest_bytes(n_own - m) <= room_bytes), 0)


# How the host chunks lie among a rank's chunks (`device_order`): "last", the host holding the last chunks (their
# gradients come first in backward, and the next forward reads them last); "spread", every other chunk from the end
# first (each host chunk's gradient follows a device chunk's backward: the host Adam behind backward gets that time
# too, where "last" hands it one host gradient after another).
HOST_ORDERS = ("last", "spread")


def device_order(n_own: int, host_order: str) -> tuple[int, ...]:
    """A rank's chunks (by index among its own) in the order they take the device; the host takes them from the end
    of it. "last": chunk order (empty: the default). "spread": the host takes the last chunk, then every other one
    before it, then the ones between, from the end."""
    if host_order == "last":
        return ()
    if host_order != "spread":
        raise ValueError(f"host_order must be one of {HOST_ORDERS}, got {host_order!r}")
    host_first = list(range(n_own - 1, -1, -2)) + list(range(n_own - 2, -1, -2))
    return tuple(reversed(host_first))


def tiers(n_chunks: int, n_device: int, world: int, rank: int,
          order: tuple[int, ...] = ()) -> tuple[list[str], list[str], list[str]]:
    """(each chunk's tier at its owner, this rank's placement, rank 0's placement). The first `n_device` chunks
    an owner holds in `order` (`device_order`; chunk order when empty) are on its device; in a rank's placement,
    the chunks others own are "remote". Rank 0 owns the most chunks: what shapes the collective schedule is planned
    for it."""
    position = {j: i for i, j in enumerate(order)}
    tier_of = ["device" if position.get(c // world, c // world) < n_device else "host" for c in range(n_chunks)]
    placement = [tier_of[c] if c % world == rank else "remote" for c in range(n_chunks)]
    rank0_placement = [tier_of[c] if c % world == 0 else "remote" for c in range(n_chunks)]
    return tier_of, placement, rank0_placement


def n_compute_slots(sizes: StepBytes, *, budget_bytes: int | None, fixed_bytes: int, n_device: int, n_own: int,
                    min_slots: int, n_slot_chunks: int) -> tuple[int, str | None]:
    """(compute slots, a note when fewer than the chunks that need one): as many as the budget leaves, at least
    what one op reads."""
    if not n_slot_chunks:
        return 0, None
    staging_bytes = sizes.device_staging_bytes if n_device < n_own else 0
    n_spare_slots = (n_slot_chunks if budget_bytes is None else
                     (budget_bytes - fixed_bytes - staging_bytes - sizes.first_bytes(n_device))
                     // sizes.compute_chunk_bytes)
    slots = max(min_slots, min(n_slot_chunks, n_spare_slots))
    if slots < n_slot_chunks:
        return slots, f"{slots} compute slots for {n_slot_chunks} chunks: Belady eviction refetches the rest"
    return slots, None
