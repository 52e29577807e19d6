"""correction: what a step costs when clipping triggers — the price of correcting it after the verdict, per
transaction, as the runtime corrects today (runtime/transactions.py, undo.py). The planner reports it beside the
untriggered step (`Plan.estimated_triggered_step_seconds`); it does not yet choose the transaction by it.
"""
from __future__ import annotations

from ..layout import Layout
from .costs import Rates
from .host_adam import worker_stall


def device_correction_bytes(itemsize: int) -> int:
    """Bytes per element a device chunk's correction moves (the Triton adam_undo with a redo, in one pass): reads the
    fp32 master and moments (12 B) and the kept gradient (the compute dtype's `itemsize`), writes the master and
    moments (12 B) and, with a 16-bit compute, the chunk's compute copy (`itemsize`): 28 B for bf16 and for fp32."""
    return 24 + itemsize + (itemsize if itemsize < 4 else 0)


DEVICE_RESTORE_BYTES = 16    # a replay's master restore (adam_undo part "param"): reads master and moments, writes it


def _triggered_seconds(transaction: str, step_seconds: float, *, cuda: bool, placement: list[str], layout: Layout,
                       node_secs: list[float], reads: list[set[int]], adam_at: dict[int, int], rates: Rates,
                       itemsize: int, copy_s: dict[int, float], kept_on_device: bool, copies_exposed: float,
                       adam_hidden: float, replay_host_exposed: float = 0.0) -> float:
    """The step's seconds when clipping triggers (global norm > grad_clip), as the runtime corrects it today
    (runtime/transactions.py, undo.py). Only kept_grads and replay correct after the verdict; deferred, accumulate
    and none apply after it or not at all, and a two_pass step that measures first already counts its second pass:
    `step_seconds`. The device's own Adam is not in the estimate (rt.adam nodes cost nothing in node_seconds), so a
    device chunk's correction is priced by its bytes at the memory bandwidth (`device_correction_bytes`).

    kept_grads: the correction first waits for every host update of the step (`Undo.applied_chunks` settles them),
    so the host Adam the untriggered estimate hid behind the next forward (`adam_hidden`) is exposed. Then, on the
    CUDA runtime:
      device chunks, serial on the launching thread and the compute stream, before the next forward's GPU work:
        device_s = elems * (device_correction_bytes / mem_bw + (0 if kept on the device else itemsize / h2d_bw))
        (a kept gradient on the host comes back first, a blocking copy into a gradient slot: `KeptGradients.on_tier`)
      host chunks, on the worker in update order at `host_correction` parameters/s, submitted once the launching
        thread is done with the device chunks (at device_s when it blocked on those copies, else at once); the
        next forward stalls where it reads a host chunk not yet corrected and copied (`host_adam.worker_stall`)
      triggered = step_seconds + adam_hidden + device_s + host stall
    On the CPU runtime every job is inline, a "device" chunk's too (the C++ kernel on CPU memory):
      triggered = step_seconds + every updated chunk's elems / host_correction
    replay: the step runs again: after the same wait, the masters are restored (device chunks: DEVICE_RESTORE_BYTES
    per element at mem_bw, serial; host chunks on the worker, priced at the correction's rate: an upper bound, the
    restore does half its arithmetic over 16 of its 28 B), then one more forward+backward with its exposed copies,
    and its host jobs (each chunk's moments undone and the update redone: the correction's kernel) exposed as the
    host Adam's pipeline would be at host_correction (`replay_host_exposed`):
      triggered = step_seconds + adam_hidden + restore + sum(node_secs) + copies_exposed + replay_host_exposed
    The replayed pass's host jobs queue on the one worker behind the restores the forward did not wait for, which
    this does not count: a lower bound where host work dominates (GPT3_18B on the H200, RESULTS "the step as a transaction",
    2026-12-01: 8.6 s of host work on one worker in a replayed step). Data-parallel plans: rank 0's chunks; the collectives' floor on
    the step is not applied to the second pass."""
    if transaction not in ("kept_grads", "replay"):
        return step_seconds
    undo = rates.host_correction
    elems = lambda tier: sum(layout.chunks[c].used_elems for c in adam_at if placement[c] == tier)  # noqa: E731
    again = sum(node_secs) + copies_exposed + replay_host_exposed if transaction == "replay" else 0.0
    if not cuda:
        return step_seconds + (elems("device") + elems("host")) / undo + again
    if transaction == "kept_grads":
        device_s = elems("device") * (device_correction_bytes(itemsize) / rates.mem_bw
                                      + (0.0 if kept_on_device else itemsize / rates.h2d_bw))
        host_start = 0.0 if kept_on_device else device_s
    else:
        device_s, host_start = elems("device") * DEVICE_RESTORE_BYTES / rates.mem_bw, 0.0
    # host jobs in update order (runtime/undo.py): the forward's first host chunk is about the last one done
    host = [c for c in sorted(adam_at, key=adam_at.__getitem__) if placement[c] == "host"]
    host_s = worker_stall(host, layout, node_secs, reads, undo, copy_s, worker_start=host_start,
                          forward_start=device_s)
    return step_seconds + adam_hidden + device_s + host_s + again
