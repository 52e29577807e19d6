"""report: the plan in words — its summary, why it does not fit, what the chosen transaction costs, and the
planner's notes. Text only: every figure here was decided by another stage.
"""
from __future__ import annotations

from ..config import Config, format_bytes
from .costs import Rates
from .memory import CUDA_BLOCK_BYTES

# The functions read a Plan and its records (`plan.py`) by their fields; they do not import them, so that the
# records can print themselves (`Plan.summary`) without a circle of imports.


def summary(plan) -> str:
    """The plan as `Plan.summary()` prints it."""
    lines = ["plan:"]
    lines.append(f"  device peak {format_bytes(plan.device_peak_bytes)}"
                 + (f" of budget {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else "")
                 + ": " + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.device_breakdown.items()))
    lines.append(f"  host peak {format_bytes(plan.host_peak_bytes)}: "
                 + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.host_breakdown.items()))
    n_dev, n_host = plan.placement.count("device"), plan.placement.count("host")
    lines.append(f"  placement: {n_dev} chunk(s) on device, {n_host} on host"
                 + (f", {len(plan.placement) - n_dev - n_host} owned by the other {plan.world - 1} rank(s) "
                    f"(rank {plan.rank} of {plan.world}; chunk c is owned by rank c % {plan.world})"
                    if plan.world > 1 else "") + ": " + _ranges(plan.placement))
    crossing = {k: plan.ship.count(k) for k in ("shadow", "cast", "fp32", "frozen") if k in plan.ship}
    if crossing:
        lines.append("  host chunks reach the device as: " + ", ".join(f"{k} {v}" for k, v in crossing.items())
                     + " (shadow: 16-bit host copy written by the host Adam; fp32: cast on the device; frozen: its "
                       "weights as they are)")
    lines.append(f"  {plan.slots} compute slot(s), {plan.grad_slots} gradient slot(s), "
                 f"{plan.host_grad_buffers} host gradient buffer(s); "
                 f"{plan.fetches} chunk fetch(es) per step; estimated step {plan.estimated_step_seconds:.3g} s"
                 + (f" ({plan.estimated_triggered_step_seconds:.3g} s when clipping triggers"
                    + (f", {plan.estimate.deferred_step_seconds:.3g} s deferred" if plan.defer_above is not None
                       else "") + ")" if plan.estimate.clips else ""))
    if plan.recompute:
        lines.append(f"  recompute: {plan.recompute}")
    lines.append(f"  chunk state: {plan.state_bytes_per_param:.3g} B/param (fp32 master + {plan.optimizer_state} "
                 "exp_avg and exp_avg_sq" + (", an fp32 scale per 256 elements each" if plan.optimizer_state
                                             == "int8" else "") + ")")
    frozen = {tier: b.get("frozen chunks", 0) for tier, b in (("device", plan.device_breakdown),
                                                              ("host", plan.host_breakdown))}
    if any(frozen.values()):
        lines.append(f"  frozen chunks: {format_bytes(frozen['device'])} on device, {format_bytes(frozen['host'])} "
                     "on host (weights in the compute dtype alone: no master, moments, gradient or update); "
                     f"trainable chunk state: {format_bytes(plan.device_breakdown['chunk state'])} on device, "
                     f"{format_bytes(plan.host_breakdown['chunk state'])} on host")
    lines.append(f"  step transaction: {plan.transaction}" + (f" ({plan.transaction_cost})"
                                                             if plan.transaction_cost else ""))
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append("  fits" if plan.fits else f"  DOES NOT FIT: {plan.why}")
    return "\n".join(lines)


def _ranges(placement: list[str]) -> str:
    out, start = [], 0
    for i in range(1, len(placement) + 1):
        if i == len(placement) or placement[i] != placement[start]:
            out.append(f"c{start}" + (f"-c{i - 1}" if i - 1 > start else "") + f"={placement[start]}")
            start = i
    return " ".join(out)


def _transaction_cost(transaction: str, config: Config, itemsize: int, kept_bytes: int, accum_bytes: int,
                      n_device: int, n_host: int, ship: list[str], second_pass_s: float, kept_copy_s: float,
                      kept_on_device: tuple[int, int], kept_in_shadow: bool = False,
                      defer_above: float | None = None, kept_in_activations: bool = False,
                      timed: bool = False) -> str:
    """What the chosen transaction costs, and how much smaller the largest model is for it. `kept_on_device`:
    (device chunks whose kept gradient stays on the device, device chunks updated); `kept_in_activations`: those
    are allocated in backward and released at the step's end (`Transaction.kept_in_activations`); `timed`: a step
    that may defer chooses by the run's timed steps (runtime/timed_switch.py: the CUDA runtime of one process)."""
    by_timing = ("once the run has timed its steps, they choose between speculating and waiting for the verdict "
                 "(runtime/timed_switch.py; PSTAR_FX_TIMED_SWITCH=0: the break-even alone)" if timed else "")
    shadow = itemsize if "shadow" in ship else 0
    state = round(config.state_bytes_per_param, 2)
    host_base = round(state + shadow, 2)                      # bytes per parameter of a host chunk without it
    if transaction == "accumulate":
        return (f"gradients of {config.grad_accum} micro-batches summed in fp32 accumulators, 4 B/param on "
                f"each chunk's tier ({format_bytes(accum_bytes * (n_device + n_host))}); every update runs after "
                f"the verdict, exactly. Chunk state {state} -> {state + 4} B/param on "
                f"the device and {host_base} -> {host_base + 4} on the host: the largest model is about "
                f"{100 * 4 / (host_base + 4):.0f}% smaller")
    n_here, n_updated = kept_on_device
    room = ("in the memory backward frees (each allocated as backward completes it, released at the step's end: a "
            "host Adam failure after the step returned cannot undo that step)" if kept_in_activations else
            "(spare room)")
    where = ("no device chunk updated" if not n_updated else
             f"device chunks' on the device {room}" if n_here == n_updated else
             f"device chunks' copied to the host (about {kept_copy_s * 1e3:.0f} ms of device->host copies, "
             "overlapped)" if not n_here else
             f"{n_here} of {n_updated} device chunks' on the device {room}, the others' copied to the host "
             f"(about {kept_copy_s * 1e3:.0f} ms of device->host copies, overlapped)")
    if transaction == "deferred":
        shadows = (", a host chunk's in its 16-bit shadow (free again before the host Adam writes the new weights "
                   "there)" if kept_in_shadow else "")
        return (f"each chunk's gradient kept until the verdict{shadows}, {itemsize} B/param "
                f"({format_bytes(kept_bytes)} on the host), {where}; nothing updated inside backward; every update "
                "is applied after the verdict from the kept gradients, exactly: no undo (what bf16 and int8 moments "
                "need), the host Adam runs after backward, into the next step's forward")
    if transaction == "kept_grads":
        switch = ("" if defer_above is None else
                  f"; a step defers its updates to the verdict instead (as 'deferred', on the same buffers: no "
                  f"correction) while the expected trigger rate (Config.expected_trigger_rate) is above "
                  f"{defer_above:.0%}")
        return (f"speculative updates inside backward; each chunk's gradient kept until the verdict, "
                f"{itemsize} B/param ({format_bytes(kept_bytes)} on the host), {where}; clipping that triggers "
                f"costs a correction pass over every chunk{switch}{'; ' + by_timing if timed else ''}; rollback "
                f"within fp32 rounding. "
                f"Host bytes per parameter of a host-bound model {host_base} -> {host_base + itemsize}: the largest "
                f"model is about {100 * itemsize / (host_base + itemsize):.0f}% smaller")
    if transaction == "replay":
        return ("speculative updates inside backward, nothing kept (the host budget does not hold the "
                f"{itemsize} B/param of kept gradients); a step that must be corrected (clipping that "
                "triggers) or rolled back (a skip, an exception) restores the masters from the moments and runs "
                "forward and backward again: free when it does not trigger, about one more step when it does; "
                + ("" if defer_above is None else
                   "a step measures first instead (as 'two_pass': no correction) while the expected trigger rate "
                   f"(Config.expected_trigger_rate) is above {defer_above:.0%}; ")
                + (by_timing + "; " if timed else "")
                + "a host Adam failure after the step returned cannot be undone")
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


def _why(memory, chunks, config: Config, min_slots: int, budget_bytes: int | None,
         host_room_chunks: int | None = None, state_bytes: int = 0) -> str:
    """Empty when the plan fits; else what is missing, where the bytes go, and what was already tried.
    `memory`, `chunks`: the plan's Memory and Placement records; `budget_bytes`: the usable device budget
    (`usable_budget`); `host_room_chunks`: how many chunks' state host_memory holds (None: unlimited);
    `state_bytes`: one chunk's state (master and moments)."""
    reasons = []
    host_budget_bytes = config.host_memory
    placement = chunks.placement
    if budget_bytes is not None and memory.device_peak_bytes > budget_bytes:
        n_owned = len(placement) - placement.count("remote")
        tried = (f"{placement.count('host')} of {n_owned} chunks' state on the host"
                 + (f" (the chunks rank {chunks.rank} owns of {len(placement)})" if chunks.world > 1 else "") + ", "
                 f"the minimum of {min_slots} compute slot(s) (what one op reads at once)"
                 if config.placement != "device" else "placement='device' forces every chunk onto the device")
        n_host = placement.count("host")
        missing_bytes = memory.device_peak_bytes - budget_bytes
        if (host_room_chunks is not None and n_host >= host_room_chunks and config.placement != "device"
                and state_bytes):
            # the device is over because the host is full: the state that does not fit there lands on the device
            more = -(-missing_bytes // state_bytes)
            reasons.append(
                f"host_memory is too small: {format_bytes(config.host_memory)} holds the state of only {n_host} of "
                f"{n_owned} chunks ({format_bytes(memory.host_peak_bytes)} in use; one more chunk's "
                f"{format_bytes(state_bytes)} does not fit beside the host's buffers), so the other "
                f"{n_owned - n_host} chunks' state must sit on the device, which then needs "
                f"{format_bytes(memory.device_peak_bytes)} against device_memory "
                f"{format_bytes(config.device_memory)}"
                + (f" ({format_bytes(budget_bytes)} usable)" if budget_bytes != config.device_memory else "")
                + f" ({format_bytes(missing_bytes)} over). Raise host_memory by "
                f"about {format_bytes(more * state_bytes)} ({more} chunks' state of {format_bytes(state_bytes)}) or "
                f"device_memory by {format_bytes(missing_bytes)}. Device bytes: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.device_breakdown.items()))
        else:
            reasons.append(
                f"the step needs {format_bytes(memory.device_peak_bytes)} of device memory but device_memory is "
                f"{format_bytes(config.device_memory)}"
                + (f" ({format_bytes(budget_bytes)} usable: the rest is kept for the allocator's fragmentation)"
                   if budget_bytes != config.device_memory else "")
                + f" ({format_bytes(missing_bytes)} missing). Device bytes: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.device_breakdown.items())
                + f". Already tried: {tried}")
    if host_budget_bytes is not None and memory.host_peak_bytes > host_budget_bytes:
        reasons.append(
            f"the host tier needs {format_bytes(memory.host_peak_bytes)} but host_memory is "
            f"{format_bytes(host_budget_bytes)} ({format_bytes(memory.host_peak_bytes - host_budget_bytes)} missing): "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.host_breakdown.items()))
    return "; ".join(reasons)


# ---- the planner's notes ----------------------------------------------------------------------------------

KEEPS_COMPUTE_COPIES_NOTE = ("every chunk has a compute slot for good: a device chunk's 16-bit compute copy stays "
                             "from step to step, written by its update, not cast from the master at each fetch")


def exposed_copies_note(exposed_seconds: float, rates: Rates) -> str:
    return (f"copies the compute cannot hide: about {exposed_seconds * 1e3:.1f} ms per step "
            f"(rates: {rates.device})")


def cuda_memory_note(config: Config, workspace_bytes: int, budget_bytes: int | None) -> str:
    return (f"CUDA memory model: each value rounded up to {CUDA_BLOCK_BYTES} B (the caching allocator's "
            f"block), plus {format_bytes(workspace_bytes)} for cuBLAS workspaces (measured) and the step's small "
            "allocations outside the graph"
            + (f"; the peak is kept {format_bytes(config.device_memory - budget_bytes)} under the budget for the "
               "allocator's fragmentation" if budget_bytes is not None else ""))


def data_parallel_note(world: int, n_fetches: int, n_reduced: int, comm_seconds: float, compute_chunk_bytes: int,
                       rates: Rates) -> str:
    return (f"data parallel over {world} ranks, chunks partitioned: {n_fetches} chunk broadcast(s) and "
            f"{n_reduced} reduce(s) per micro-batch, {format_bytes(compute_chunk_bytes)} each, about "
            f"{comm_seconds * 1e3:.1f} ms per micro-batch at a bus bandwidth of {rates.coll_bw / 1e9:.0f} GB/s")


def kept_in_activations_note(would: int, kept_on_device: int, n_updated_device: int) -> str:
    """A keeping plan made with PSTAR_FX_KEPT_IN_ACTIVATIONS off, where turning it on would keep `would` of the
    `n_updated_device` device chunks' gradients on the device instead of `kept_on_device`."""
    return (f"{would} of the {n_updated_device} device chunks' kept gradients would stay on the device in the memory "
            f"backward frees (now {kept_on_device}: the others cross to the host in backward and back after the "
            "verdict): PSTAR_FX_KEPT_IN_ACTIVATIONS=1, experimental")


def host_adam_note(adam_exposed_seconds: float, *, after_verdict: bool, kept_on_device: bool, kept: bool,
                   n_updated_device: int, n_host_grad_buffers: int) -> str:
    """`kept`: host chunks' gradients land in kept buffers (or the device chunks' stay on the device)."""
    if after_verdict:
        why = ("every update after the verdict: the host Adam runs into the next forward, which waits where it "
               "reads a host chunk not yet updated")
        if not kept_on_device and n_updated_device:
            why += "; the device chunks' kept gradients come back from the host first"
    elif kept:
        why = "each host chunk's gradient in its own kept buffer"
    else:
        why = f"{n_host_grad_buffers} host gradient buffers"
    return f"host Adam the compute cannot hide: about {adam_exposed_seconds * 1e3:.0f} ms per step ({why})"
