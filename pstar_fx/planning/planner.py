"""planner: `make_plan`, the stages in order — what each node reads and holds (placement.py, liveness.py), the bytes
they share (memory.py), how many chunks sit on the device (placement.py), the transaction (transaction.py), the
host Adam (host_adam.py), how host chunks cross (shipping.py), the chunk moves (schedule.py), the breakdowns
(memory.py), the estimate (costs.py) and the words (report.py) — and the frozen Plan built once from their results.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.fx as fx

from ..config import Config
from ..fxutil import is_random, role_nodes
from ..layout import Layout
from .costs import Rates, calibrate, host_adam_share, node_seconds
from .correction import _triggered_seconds, device_after_verdict_seconds
from .grad_slots import slot_waits
from .host_adam import _after_verdict_exposed, _host_adam_pipeline
from .liveness import activation_profile
from .memory import (CUDA_BLOCK_BYTES, device_breakdown, host_breakdown, step_bytes, usable_budget,
                     with_kept_on_device)
from .placement import (ChunkUse, chunk_use, device_order, host_room_chunks, n_compute_slots, n_device_chunks,
                        n_grad_slots, tiers)
from . import blocks, placement as placement_module
from .plan import Estimate, Memory, Moves, NodeProfile, Placement, Plan, Remarks, Shipping, Slots, Transaction
from .report import (KEEPS_COMPUTE_COPIES_NOTE, _transaction_cost, _why, cuda_memory_note, data_parallel_note,
                     exposed_copies_note, host_adam_note, kept_in_activations_note)
from .schedule import Schedule, belady, place_prefetches
from .shipping import (_choose_shipping, copy_seconds, fallback_code, keeps_compute_copies, kept_in_shadow,
                       ship_bytes_per_elem, ship_codes)
from .transaction import (KEEPS, _choose_transaction, defer_above, kept_here, kept_in_activations_bytes,
                          kept_in_activations_on, n_grad_slots_to_keep, n_kept_in_activations, n_kept_on_device,
                          two_passes)


# what a plan by block may cost the step over one op by op, estimated, for its fewer compiled functions (a cold
# compile's builds: planning/blocks.py); PSTAR_FX_SPANS_MAY_COST sets another (1: by block whatever it costs)
SPANS_MAY_COST = 0.0025
# the copy waits a plan by block adds, as measured against the schedule's estimate of them: GPT3_18B with bf16
# moments on an H100 box (51 of 69 chunks on the host), by block against op by op, waited 0.36 s a step more for
# copies where the estimate said 0.08 (bench/RESULTS.md, session 29)
SPAN_COPY_WAITS = 4.0


def spans_may_cost() -> float:
    """`SPANS_MAY_COST`, or PSTAR_FX_SPANS_MAY_COST: a fraction of the step, 0 or more; else a ValueError."""
    env = os.environ.get("PSTAR_FX_SPANS_MAY_COST")
    if env is None:
        return SPANS_MAY_COST
    try:
        cost = float(env)
    except ValueError:
        cost = -1.0
    if not cost >= 0.0:                 # (a NaN too)
        raise ValueError(f"PSTAR_FX_SPANS_MAY_COST: expected a fraction of the step, 0 or more (0.0025: a quarter "
                         f"of a per cent), got {env!r}")
    return cost


def make_plan(gm: fx.GraphModule, layout: Layout, config: Config, *, compute_itemsize: int,
              buffer_bytes: int, on: Plan | None = None, world: int = 1, rank: int = 0,
              rates: Rates | None = None, host_order: str | None = None) -> Plan:
    """Placement and schedule for the fused graph under the config's budgets (`_make_plan`), the host chunks the
    last ones. Where the host Adam runs inside backward from a pool of host gradient buffers (nothing kept: host
    chunks' gradients wait in the pool as backward produces them) and the step cannot hide all of it, the host
    chunks spread among the device chunks are planned too (placement.py `device_order`), and the plan with the lower
    estimate is kept: with the last chunks on the host their gradients come one after another, faster than the host
    Adam takes them, and once the pool is full the GPU waits (h4096 L99 with fp32 moments at 110 GiB of host:
    2 buffers, and on the H200 the launching thread waited 1.77 s a step for one); spread, each gradient follows a
    device chunk's backward. Where backward waits for gradients copied out of its one gradient slot
    (grad_slots.py) and the device has no room left for a second, a plan with a second slot in room taken from
    something else (a chunk, a compute slot) is weighed the same way. One rank, on CUDA, a plan of its own (`on`
    keeps another's placement); `host_order`: plan with that order alone (a cached decision's). Where the graph's
    nodes lie in blocks' spans (blocks.py: the compute is compiled), each span's chunks are planned resident across
    it and each update at its end (`_by_span`), and the plan op by op is made too: it is kept where estimated
    faster by more than `spans_may_cost()` (under a tight budget a slot more costs a device chunk)."""
    rates = rates or calibrate(torch.device(config.device), config.torch_dtype)
    # what the graph's nodes read, hold and cost: the same for every plan of it below (two thirds of a plan at 18B)
    facts = _graph_facts(gm, layout, config.device.startswith("cuda"), rates)
    spanned = _by_span(facts, world > 1, on)

    def better(other: Plan) -> bool:
        return other.fits >= plan.fits and other.estimated_step_seconds < plan.estimated_step_seconds - 1e-3

    plan = _make_plan(gm, layout, config, compute_itemsize=compute_itemsize, buffer_bytes=buffer_bytes, on=on,
                      world=world, rank=rank, rates=rates, host_order=host_order or "last", facts=spanned or facts)
    if spanned is not None:
        # planned op by op too: by block, a chunk is resident longer (a slot more, a copy with less compute to hide
        # behind, an update later). The plan op by op is kept where it is estimated faster by more than
        # `spans_may_cost()`, the copy waits that planning by block adds counted `SPAN_COPY_WAITS` times over
        other = _make_plan(gm, layout, config, compute_itemsize=compute_itemsize, buffer_bytes=buffer_bytes, on=on,
                           world=world, rank=rank, rates=rates, host_order=host_order or "last", facts=facts)
        added = max(0.0, plan.estimate.copies_exposed_seconds - other.estimate.copies_exposed_seconds)
        by_block = plan.estimated_step_seconds + (SPAN_COPY_WAITS - 1) * added
        faster = other.estimated_step_seconds < by_block * (1 - spans_may_cost())
        if other.fits > plan.fits or other.fits == plan.fits and faster:
            plan, spanned = other, None
    facts = spanned or facts
    if on is not None or world > 1 or not config.device.startswith("cuda"):
        return plan

    if host_order is None and plan.host_grad_buffers and plan.estimate.host_adam_exposed_seconds > 1e-3:
        for order in placement_module.HOST_ORDERS[1:]:
            other = _make_plan(gm, layout, config, compute_itemsize=compute_itemsize, buffer_bytes=buffer_bytes,
                               world=world, rank=rank, rates=rates, host_order=order, facts=facts)
            plan = other if better(other) else plan
    if plan.grad_slots < 2 and plan.estimate.grad_slot_waits_seconds > 1e-3:
        # backward waits for gradients copied out of its one gradient slot: a second, where the device room it
        # takes costs less (grad_slots.py); decided alike with or without a cached host order
        other = _make_plan(gm, layout, config, compute_itemsize=compute_itemsize, buffer_bytes=buffer_bytes,
                           world=world, rank=rank, rates=rates, host_order=plan.chunks.host_order,
                           grad_slots=2, facts=facts)
        plan = other if better(other) else plan
    return plan


def _make_plan(gm: fx.GraphModule, layout: Layout, config: Config, *, compute_itemsize: int,
               buffer_bytes: int, on: Plan | None = None, world: int = 1, rank: int = 0,
               rates: Rates, facts: GraphFacts, host_order: str = "last", grad_slots: int = 0) -> Plan:
    """Placement and schedule for the fused graph under the config's budgets, the host chunks lying as
    `host_order` says (placement.py `device_order`), with at least `grad_slots` gradient slots, from the graph's
    `facts` at `rates`. Never raises for memory:
    a plan that does not fit says so (`fits`, `why`); compile() turns that into a BudgetError.
    `on`: schedule this graph on another plan's chunk memory and runtime (its placement, shipping, compute and
    gradient slots, host gradient buffers, transaction and device-kept gradients: what the runtime built from it
    allocated), as evaluation and a training step of another input shape do on the compiled step's; only the
    moves, the activations and the estimate are this graph's own.

    `world` > 1: chunk-partitioned data parallelism. Chunk c is owned by rank c % world, which alone holds
    its state; the others' chunks are "remote" in this rank's placement. The schedule is a collective
    contract (every rank broadcasts and reduces the same chunks in the same order), so everything that
    shapes it is planned for rank 0, which owns the most chunks (ceil(n / world)), and applied to every
    rank by the chunk's index among its owner's chunks: the k-th chunk a rank owns sits on the same tier
    on every rank. `rates` must then be the same on every rank (the engine broadcasts rank 0's). A rank that
    owns fewer chunks than rank 0 is planned like it: its peaks are an upper bound of what it allocates."""
    g = gm.graph
    n_chunks, chunk_elems = len(layout.chunks), layout.chunk_size
    fp32, chunked, cuda = compute_itemsize == 4, world > 1, config.device.startswith("cuda")
    n_own = len(range(0, n_chunks, world))   # rank 0's chunks: the most any rank owns
    notes: list[str] = []

    # what each node reads, holds and costs, and the byte sizes the stages share
    nodes, use, act_bytes_per_node, act_peak_bytes, node_secs, _, _ = facts
    host_order = on.chunks.host_order if on is not None else host_order
    sizes = replace(step_bytes(g, layout, config, compute_itemsize=compute_itemsize, buffer_bytes=buffer_bytes,
                               activation_peak_bytes=act_peak_bytes, rates=rates, cuda=cuda, world=world),
                    order=device_order(n_own, host_order))
    budget_bytes = usable_budget(config.device_memory, cuda)

    # placement, then the transaction the host leaves room for (which may ask for a second gradient slot)
    n_grad = max(n_grad_slots(use, chunked), grad_slots)
    fixed_bytes = sizes.device_fixed_bytes(n_grad)
    room_chunks = host_room_chunks(sizes, config, n_own)

    def place(fixed_bytes: int) -> int:
        return n_device_chunks(sizes, config, budget_bytes=budget_bytes, fixed_bytes=fixed_bytes, n_own=n_own,
                               min_slots=use.min_slots, fp32=fp32, chunked=chunked, host_room_chunks=room_chunks)

    n_device = place(fixed_bytes) if on is None else on.n_device
    random_ops = [n.name for n in nodes if n.op == "call_function" and is_random(n)]
    n_updated = sum(1 for c, ch in enumerate(layout.chunks) if ch.grad_spans() and c % world == 0)
    kept_total = n_updated * sizes.grad_chunk_bytes

    def host_free(n_device: int) -> int | None:
        """Host bytes left for kept gradients with `n_device` chunks on the device."""
        return (None if config.host_memory is None else config.host_memory - sizes.host_overhead_bytes
                - sizes.kept_staging_bytes - sizes.rest_bytes(n_device))

    transaction, kept_bytes = _choose_transaction(config, kept_total, host_free=host_free(n_device),
                                                  random_ops=random_ops)
    if on is not None:
        # another plan's runtime runs this graph: its gradient slots and transaction, whatever this graph would pick
        transaction, n_grad = on.transaction, on.grad_slots
        fixed_bytes = sizes.device_fixed_bytes(n_grad)
    elif n_grad_slots_to_keep(transaction, n_grad, cuda=cuda, n_device=n_device) != n_grad:
        # a second slot, unless it leaves a chunk fewer on the device whose state on the host then leaves no room
        # for the kept gradients: one slot then (30.0B with int8 moments: planned deferred with 1.84 GiB of host
        # missing, where one slot fits)
        n_device_two = place(fixed_bytes + sizes.grad_chunk_bytes)
        room = host_free(n_device_two)
        if room is None or kept_total <= room:
            n_grad, fixed_bytes, n_device = 2, fixed_bytes + sizes.grad_chunk_bytes, n_device_two
    n_host = n_own - n_device
    if host_order == "spread" and n_host and n_device:
        notes.append("host chunks spread among the device chunks (every other one from the end first): each host "
                     "chunk's gradient reaches the host Adam after a device chunk's backward")
    tier_of, placement, rank0_placement = tiers(n_chunks, n_device, world, rank, sizes.order)
    n_updated_device = sum(1 for c, ch in enumerate(layout.chunks)
                           if ch.grad_spans() and rank0_placement[c] == "device")
    # an fp32 device chunk computes on its master, a frozen device chunk on its weights: neither needs a slot
    frozen = [ch.frozen for ch in layout.chunks]
    needs_slot = [chunked or not ((fp32 or frozen[c]) and tier_of[c] == "device") for c in range(n_chunks)]
    device_chunks = [c for c in range(n_chunks) if rank0_placement[c] == "device"]
    host_chunks = [c for c in range(n_chunks) if rank0_placement[c] == "host"]
    n_slots, slots_note = n_compute_slots(sizes, budget_bytes=budget_bytes, fixed_bytes=fixed_bytes, n_device=n_device,
                                          n_own=n_own, min_slots=use.min_slots, n_slot_chunks=sum(needs_slot))
    notes += [slots_note] if slots_note else []
    n_slots = on.slots if on is not None else n_slots

    # the host Adam inside backward (a deferred step's runs after the verdict: timed once the copies are known)
    host_adam_rate = rates.host_adam_with(config.optimizer_state)
    host_used_bytes = sizes.rest_bytes(n_device) + sizes.host_staging_bytes
    n_spare_buffers = (None if config.host_memory is None
                       else (config.host_memory - host_used_bytes) // sizes.grad_chunk_bytes)
    after_verdict = transaction == "deferred" and cuda and bool(kept_bytes)
    n_host_grad, adam_exposed, adam_hidden = (0, 0.0, 0.0) if after_verdict else _host_adam_pipeline(
        rank0_placement, layout, node_secs, use.reads, use.adam_at, host_adam_rate, cuda, n_spare_buffers)
    n_host_grad = on.host_grad_buffers if on is not None else n_host_grad   # the pool the runtime allocated
    host_ids = [c for c in range(n_chunks) if tier_of[c] == "host" and c % world == rank]
    in_shadow = (on.kept_in_shadow if on is not None else
                 kept_in_shadow(transaction, layout, host_ids, fp32=fp32, world=world))
    host_frozen = [frozen[c] for c in host_chunks]              # rank 0's k-th host chunk: frozen?
    # (chunked: a ring broadcast or reduce moves the whole buffer through every link: bytes / bus bandwidth)
    coll_seconds = sizes.compute_chunk_bytes / rates.coll_bw if chunked else 0.0
    slot_reads = [{c for c in r if needs_slot[c]} for r in use.reads]
    # the updated device chunks in the order they keep their gradients on the device (`kept_here`: the first
    # kept_on_device do, the others' go to the host), and their update nodes
    updated_device = kept_here([c for c in use.adam_at if rank0_placement[c] == "device"], len(use.adam_at))
    kept_at = [use.adam_at[c] for c in updated_device]

    def ship_and_move(pool: int) -> _Moving:
        """Shipping, the chunk moves, the memory and the host Adam beside the copies, with `pool` host gradient
        buffers (the host room they take is the 16-bit shadows' room)."""
        used, n_pool, kept = host_used_bytes, pool, kept_bytes
        if kept:                       # every host chunk's gradient lands in its own kept buffer: no pool
            n_pool = 0
            used = sizes.rest_bytes(n_device) + sizes.host_overhead_bytes + sizes.kept_staging_bytes + kept
        else:
            used += max(0, pool - 2) * sizes.grad_chunk_bytes
        host_ship = (["frozen" if f else "shadow" for f in host_frozen] if in_shadow else
                     _choose_shipping(host_frozen, config, chunk_elems, compute_itemsize, cuda, host_used_bytes=used))
        ship_of, ship = ship_codes(tier_of, host_ship, world=world, rank=rank, frozen=frozen,
                                   fallback=fallback_code(compute_itemsize, cuda))
        ship = list(on.ship) if on is not None else ship
        copy_s = copy_seconds(ship_of, chunk_elems, compute_itemsize, rates, coll_seconds)
        sched = place_prefetches(belady(slot_reads, n_slots), n_slots, node_secs, copy_s) if n_slots else Schedule()

        # memory: the breakdowns, and whether the device chunks' kept gradients stay on the device
        device = device_breakdown(sizes, device_chunks=device_chunks, n_slots=n_slots, n_grad_slots=n_grad,
                                  host_ship=host_ship, chunk_elems=chunk_elems, fp32=fp32)
        host = host_breakdown(sizes, host_chunks=host_chunks, n_host_grad_buffers=n_pool, host_ship=host_ship,
                              kept_in_shadow=in_shadow, kept_bytes=kept)
        kept_on_device, in_acts = (on.kept_on_device, on.kept_in_activations) if on is not None else (0, False)
        would = 0                      # how many would stay in what backward frees, were that on (a note)
        if on is None and transaction in KEEPS:
            kept_on_device = n_kept_on_device(n_updated_device, sizes.grad_chunk_bytes, sum(device.values()),
                                              budget_bytes)
            if kept_on_device < n_updated_device and not chunked:
                # none or some fit beside the peak all step: more may in what backward frees, allocated as it
                # completes each, released at the step's end
                n_acts = n_kept_in_activations(kept_at, act_bytes_per_node, sizes.grad_chunk_bytes,
                                               sum(device.values()), device["activations"], budget_bytes)
                if n_acts > kept_on_device:
                    if kept_in_activations_on():
                        kept_on_device, in_acts = n_acts, True
                    else:
                        would = n_acts
        if kept_on_device:
            here = (kept_in_activations_bytes(kept_at[:kept_on_device], act_bytes_per_node, sizes.grad_chunk_bytes,
                                              device["activations"]) if in_acts
                    else kept_on_device * sizes.grad_chunk_bytes)
            device, host = with_kept_on_device(device, host, here, kept_on_device * sizes.grad_chunk_bytes)
            kept -= kept_on_device * sizes.grad_chunk_bytes

        # the host Adam shares the host's memory with the step's PCIe copies: its rate beside them (costs.py
        # host_adam_share), from the bytes this schedule moves over the step's compute
        kept_copy_s = (n_updated_device - kept_on_device) * sizes.grad_chunk_bytes / rates.d2h_bw
        rate, exposed, hidden = host_adam_rate, adam_exposed, adam_hidden
        if cuda and host_chunks:
            moved = _copy_bytes(sched, ship_of, chunk_elems, compute_itemsize, host_chunks, frozen) \
                + (kept_copy_s * rates.d2h_bw if transaction in KEEPS else 0.0)
            share = host_adam_share(rate, config.optimizer_state, moved / max(sum(node_secs), 1e-9))
            rate *= share
            if share < 1.0 and not after_verdict:
                _, exposed, hidden = _host_adam_pipeline(rank0_placement, layout, node_secs, use.reads, use.adam_at,
                                                         rate, cuda, n_spare_buffers, buffers=pool)
        return _Moving(n_pool, host_ship, ship_of, ship, copy_s, sched, device, host, kept_on_device, in_acts,
                       would, kept, kept_copy_s, rate, exposed, hidden)

    moving = ship_and_move(n_host_grad)
    if on is None and cuda and not after_verdict and not kept_bytes and moving.host_adam_exposed > 1e-3:
        # the pool was sized at the host Adam's rate alone, and beside the step's copies it runs slower: a pool
        # sized at that rate hides more of it, in host room the shipping would give 16-bit shadows (more bytes
        # cross for each chunk without one); whichever the estimate prices lower (GPT3_18B with fp32 moments at
        # 110 GiB of host, the H200's rates: 7 buffers expose 132 ms of host Adam at 5.4 G params/s, 12 none)
        larger, _, _ = _host_adam_pipeline(rank0_placement, layout, node_secs, use.reads, use.adam_at,
                                           moving.host_adam_rate, cuda, n_spare_buffers)
        if larger > n_host_grad:
            other = ship_and_move(larger)
            if other.exposed_seconds < moving.exposed_seconds - 1e-4:
                n_host_grad, moving = larger, other
    (n_host_grad, host_ship, ship_of, ship, copy_s, sched, device, host, kept_on_device, kept_in_acts, would,
     kept_bytes, kept_copy_s, host_adam_rate, adam_exposed, adam_hidden) = moving
    if sched.exposed_seconds > 1e-4:
        notes.append(exposed_copies_note(sched.exposed_seconds, rates))
    if would:
        notes.append(kept_in_activations_note(would, kept_on_device, n_updated_device))
    # backward's gradients copied out of the gradient slots: host chunks', and device chunks' kept on the host
    grad_waits = 0.0
    if cuda and not chunked:
        shipped = {c for c in use.adam_at if rank0_placement[c] == "host"}
        if transaction in KEEPS:
            shipped |= set(updated_device[kept_on_device:])
        copy_out = sizes.grad_chunk_bytes / rates.d2h_bw
        grad_waits = slot_waits(use.grad_first, use.adam_at, shipped, node_secs, n_grad, copy_out)
        if (grad_waits > 1e-3 and n_grad < 2 and on is None and budget_bytes is not None
                and budget_bytes - sum(device.values()) >= sizes.grad_chunk_bytes):
            # a second slot in device room the plan leaves free: nothing else changes (make_plan weighs one that
            # takes room from something else)
            n_grad += 1
            device["gradient slots"] += sizes.grad_chunk_bytes
            grad_waits = slot_waits(use.grad_first, use.adam_at, shipped, node_secs, n_grad, copy_out)
        if grad_waits > 1e-3:
            notes.append(f"backward waits about {grad_waits * 1e3:.0f} ms a step for gradients copied to the host out "
                         f"of its {n_grad} gradient slot(s) before the next chunk's gradient can take one")
    keeps_copies = keeps_compute_copies(n_slots, sum(needs_slot), world, config.torch_dtype)
    notes += [KEEPS_COMPUTE_COPIES_NOTE] if keeps_copies else []
    if facts.by_block:
        notes.append(f"planned by block (planning/blocks.py): each block's chunks resident across it, "
                     f"{len(facts.updates_after)} updates moved to their block's end, so that every block's compiled "
                     "region is one function (PSTAR_FX_BLOCK_SPANS=0: op by op)")
    notes += [cuda_memory_note(config, sizes.workspace_bytes, budget_bytes)] if cuda else []
    chunks = Placement(placement, n_device, world, rank, host_order)
    memory = Memory(sum(device.values()), sum(host.values()), device, host, act_peak_bytes, config.optimizer_state,
                    config.state_bytes_per_param, budget_bytes=config.device_memory,
                    host_budget_bytes=config.host_memory, grad_chunk_bytes=sizes.grad_chunk_bytes)

    # kept_grads or replay chosen by "auto" with clipping: the step is also priced with its updates waiting for the
    # verdict, on the same buffers (kept_grads: deferred; replay: two_pass, measuring first, which keeps nothing
    # either), and the runtime defers while the expected trigger rate is above the break-even (not yet with data
    # parallelism)
    adaptive = (transaction in ("kept_grads", "replay") and config.transaction == "auto"
                and config.grad_clip is not None and not chunked)
    alone = rates.host_adam_with(config.optimizer_state)
    share = host_adam_rate / alone if alone else 1.0      # the host Adam's rate beside the copies, of its own

    # the estimate: compute (recompute included) + copies not hidden + host Adam that compute can't hide
    # (the CPU runtime runs every host Adam inline, after the verdict or inside backward alike)
    deferred_exposed = adam_exposed
    if cuda and (after_verdict or (adaptive and transaction == "kept_grads")):
        # device chunks' updates after the verdict: those whose kept gradient is on the device (the first
        # `kept_on_device`), and those whose comes back from the host
        device_s = device_after_verdict_seconds(updated_device[:kept_on_device], updated_device[kept_on_device:],
                                                layout, node_secs, use.reads, compute_itemsize, rates)
        # (at the host Adam's rate beside the step's copies: priced beside the kept gradients coming back as well,
        # the deferred step at Llama-3-8B's shape came out dearer than the speculated one, against the H200's
        # 1.403 s deferred and 1.455 speculated: RESULTS, session 21)
        deferred_exposed = _after_verdict_exposed(rank0_placement, layout, node_secs, use.reads, use.adam_at,
                                                  host_adam_rate, copy_s, device_s)
    if after_verdict:
        adam_exposed = deferred_exposed
    # device chunks' gradients kept in activations are copied out of their slot (KeptGradients.keep): each read
    # and written once at the device's memory speed, in backward
    acts_copy = kept_on_device * sizes.grad_chunk_bytes * 2 / rates.mem_bw if kept_in_acts and cuda else 0.0
    step_seconds = sum(node_secs) + sched.exposed_seconds + grad_waits + acts_copy + adam_exposed
    if chunked:
        # every broadcast and reduce runs on one collective stream, in graph order: the step takes at least
        # their sum. The broadcasts' wait is in the schedule's exposed time; the reduces overlap backward.
        n_reduced = sum(1 for ch in layout.chunks if ch.grad_spans())
        comm_seconds = (sched.fetches + n_reduced) * coll_seconds      # per micro-batch, like the estimate
        step_seconds = max(step_seconds, comm_seconds)
        notes.append(data_parallel_note(world, sched.fetches, n_reduced, comm_seconds, sizes.compute_chunk_bytes,
                                        rates))
    measures_first = two_passes(transaction, config, random_ops)
    if measures_first:
        step_seconds += sum(node_secs)
    # a replayed pass's host jobs (each chunk's moments undone, the update redone) run the correction's kernel
    _, replay_host_exposed, _ = (_host_adam_pipeline(rank0_placement, layout, node_secs, use.reads, use.adam_at,
                                                     rates.host_correction * share, cuda, n_spare_buffers)
                                 if transaction == "replay" else (0, 0.0, 0.0))
    triggered_seconds = _triggered_seconds(
        transaction, step_seconds, cuda=cuda, placement=rank0_placement, layout=layout, node_secs=node_secs,
        reads=use.reads, adam_at=use.adam_at, rates=rates, itemsize=compute_itemsize, copy_s=copy_s,
        kept_on_device=kept_on_device, copies_exposed=sched.exposed_seconds, adam_hidden=adam_hidden,
        replay_host_exposed=replay_host_exposed, host_adam_rate=host_adam_rate)
    deferred_seconds = None
    if adaptive:
        deferred_seconds = (sum(node_secs) + sched.exposed_seconds + grad_waits + acts_copy + deferred_exposed
                            if transaction == "kept_grads"
                            else step_seconds + sum(node_secs))    # two_pass's estimate: one more forward+backward
    switch = defer_above(step_seconds, triggered_seconds, deferred_seconds) if adaptive else None
    cost = _transaction_cost(transaction, config, compute_itemsize, kept_bytes, sizes.accum_bytes,
                             sizes.split(device_chunks)[0], sizes.split(host_chunks)[0],   # trainable chunks
                             host_ship, sum(node_secs) if measures_first else 0.0, kept_copy_s,
                             (kept_on_device, n_updated_device), in_shadow, switch, kept_in_acts,
                             timed=adaptive and cuda and world == 1)
    if adam_exposed > 1e-3:
        notes.append(host_adam_note(adam_exposed, after_verdict=after_verdict,
                                    kept_on_device=kept_on_device == n_updated_device,
                                    kept=bool(kept_bytes) or kept_on_device, n_updated_device=n_updated_device,
                                    n_host_grad_buffers=n_host_grad))

    tangent_users = {u for t in role_nodes(g, "tangent") for u in t.users}    # backward's first ops
    profile = NodeProfile([n.name for n in nodes], act_bytes_per_node,
                          next((i for i, n in enumerate(nodes) if n in tangent_users), len(nodes)),
                          use.adam_at, chunk_elems=chunk_elems, param_elems=layout.param_elems)
    return Plan(
        chunks=chunks, buffers=Slots(n_slots, n_grad, n_host_grad),
        moves=Moves({nodes[i].name: ops for i, ops in sched.before.items()},
                    {nodes[i].name: ops for i, ops in sched.after.items()}, sched.fetches,
                    {c: nodes[i].name for c, i in facts.updates_after.items()}, facts.by_block),
        memory=memory, shipping=Shipping(ship, keeps_copies),
        step_transaction=Transaction(transaction, not random_ops, measures_first, kept_on_device, switch, in_shadow,
                                     cost, kept_in_acts),
        estimate=Estimate(step_seconds, rates, triggered_seconds, config.grad_clip is not None, deferred_seconds,
                          compute_seconds=sum(node_secs) * (2 if measures_first else 1),
                          copies_exposed_seconds=sched.exposed_seconds + grad_waits + acts_copy,
                          grad_slot_waits_seconds=grad_waits, host_adam_exposed_seconds=adam_exposed,
                          host_adam_rate=host_adam_rate if host_chunks else 0.0),
        remarks=Remarks(notes, _why(memory, chunks, config, use.min_slots, budget_bytes, room_chunks,
                                       sizes.state_bytes)), profile=profile)


class GraphFacts(NamedTuple):
    """What every `_make_plan` of one graph reads alike (make_plan plans a try's graph up to three times: host
    orders, a second gradient slot)."""
    nodes: list[fx.Node]
    use: ChunkUse
    activation_bytes: list[int]      # live graph values while each node runs
    activation_peak_bytes: int
    node_seconds: list[float]        # each node's cost at the plan's rates
    updates_after: dict = {}         # chunk -> the node its update is planned after, where not its own (by span)
    by_block: bool = False           # the reads and updates are by block's span (`_by_span`)


def _graph_facts(gm: fx.GraphModule, layout: Layout, cuda: bool, rates: Rates) -> GraphFacts:
    g = gm.graph
    nodes = list(g.nodes)
    param_nodes = role_nodes(g, "param")
    use = chunk_use(nodes, param_nodes, layout)
    skip = set(param_nodes) | set(role_nodes(g, "buffer")) | set(role_nodes(g, "rt"))
    act_bytes_per_node, act_peak_bytes = activation_profile(g, skip=skip, round_to=CUDA_BLOCK_BYTES if cuda else 1,
                                                            cuda=cuda)
    return GraphFacts(nodes, use, act_bytes_per_node, act_peak_bytes, [node_seconds(n, rates) for n in nodes])


def _by_span(facts: GraphFacts, chunked: bool, on: Plan | None) -> GraphFacts | None:
    """`facts` planned by block (blocks.py), None where the graph has no spans: each span's chunks read at its first
    and last node, where they are no more than one op reads, or two (a block across a chunk boundary), and no more
    than `on`'s compute slots (another plan's, where this graph runs on them); each update at the end of its span,
    unless that takes more gradient slots than `on` has."""
    spans = [n.meta.get(blocks.SPAN) for n in facts.nodes]
    if all(s is None for s in spans):
        return None
    limit = max(facts.use.min_slots, 2) if on is None else min(max(facts.use.min_slots, 2), on.slots)
    reads, widened = blocks.widen(facts.use.reads, spans, limit)
    moved = blocks.updates_at_ends(facts.use.adam_at, spans, widened)
    use = replace(facts.use, reads=reads, adam_at={**facts.use.adam_at, **moved})
    if on is not None and n_grad_slots(use, chunked) > on.grad_slots:
        use, moved = replace(use, adam_at=facts.use.adam_at), {}
    return facts._replace(use=use, updates_after=moved, by_block=True)


class _Moving(NamedTuple):
    """What make_plan's `ship_and_move` decided for one size of the host gradient pool."""
    n_host_grad: int
    host_ship: list[str]
    ship_of: list[str]
    ship: list[str]
    copy_s: dict[int, float]
    sched: Schedule
    device: dict[str, int]
    host: dict[str, int]
    kept_on_device: int
    kept_in_activations: bool
    kept_in_activations_would: int   # (off) how many would stay in what backward frees, were it on
    kept_bytes: int
    kept_copy_s: float
    host_adam_rate: float       # beside the step's copies
    host_adam_exposed: float
    host_adam_hidden: float

    @property
    def exposed_seconds(self) -> float:
        """What the step adds to its compute: copies and host Adam it cannot hide."""
        return self.sched.exposed_seconds + self.host_adam_exposed


def _copy_bytes(sched: Schedule, ship_of: list[str], chunk_elems: int, compute_itemsize: int, host_chunks: list[int],
                frozen: list[bool]) -> float:
    """Bytes a step moves over PCIe, each way through host memory: every fetch of a compute copy (the schedule's,
    at its chunk's shipping size), and each trainable host chunk's gradient coming back."""
    fetched = sum(chunk_elems * ship_bytes_per_elem(ship_of[c], compute_itemsize)
                  for moves in sched.before.values() for kind, c in moves
                  if kind == "fetch" and ship_of[c] != "remote")   # (another rank's comes by collective)
    return fetched + sum(chunk_elems * compute_itemsize for c in host_chunks if not frozen[c])
