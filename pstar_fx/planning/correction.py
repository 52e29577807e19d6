"""correction: what a step costs when clipping triggers — the price of correcting it after the verdict, per
transaction, as the runtime corrects (runtime/transactions.py, undo.py) — and what the device's part of any work
after the verdict costs (a correction's, or a deferred step's updates). The planner reports the triggered step
beside the untriggered one (`Plan.estimated_triggered_step_seconds`) and, for a kept_grads plan that may defer,
chooses by them the trigger rate above which a step defers (`transaction.defer_above`).
"""
from __future__ import annotations

from ..layout import Layout
from .costs import Rates, host_adam_share
from .host_adam import first_reads, worker_stall
from .transaction import kept_here


def device_correction_bytes(itemsize: int) -> int:
    """Bytes per element a device chunk's correction moves (the Triton adam_undo with a redo, in one pass): reads the
    fp32 master and moments (12 B) and the kept gradient (the compute dtype's `itemsize`), writes the master and
    moments (12 B) and, with a 16-bit compute, the chunk's compute copy (`itemsize`): 28 B for bf16 and for fp32."""
    return 24 + itemsize + (itemsize if itemsize < 4 else 0)


def device_after_verdict_seconds(here: list[int], back: list[int], layout: Layout, node_secs: list[float],
                                 reads: list[set[int]], itemsize: int, rates: Rates) -> float:
    """Seconds device chunks' updates or corrections after the verdict add to the next forward. They run on a
    stream of their own beside it (runtime/movers.py `Mover.after_verdict`), `here` first (their kept gradient is on
    the device), then `back`, whose kept gradients come back from the host on the copy stream one after another
    from the verdict on (runtime/kept.py `on_device_in_order`); each kernel reads and writes its chunk's state at
    memory speed (`device_correction_bytes` per element) once its gradient is there and the one before has run.
    The forward waits where it reads a chunk whose kernel has not run; where it does not wait, the kernels share
    the device's memory with it: the larger of the two."""
    kernel = lambda c: layout.chunks[c].used_elems * device_correction_bytes(itemsize) / rates.mem_bw  # noqa: E731
    first_read, end = first_reads(node_secs, reads)
    landed, done, stall = 0.0, 0.0, 0.0
    for c in here + back:
        if c in back:
            landed += layout.chunks[c].used_elems * itemsize / rates.h2d_bw
        done = max(done, landed if c in back else 0.0) + kernel(c)
        stall = max(stall, done - first_read.get(c, end))
    return max(stall, sum(kernel(c) for c in here + back))


def host_correction_share(rate: float, host_elems: int, back_bytes: float, rates: Rates) -> float:
    """The share of `rate` the host corrections after the verdict run at while the device chunks' kept gradients come
    back from the host (`back_bytes`, at the copy rate from the verdict on): both pass through host memory, as the
    host Adam and the step's copies do (costs.py `host_adam_share`; a correction moves the fp32 Adam's bytes),
    averaged over the longer of the two. At Llama-3-8B's shape on the H200 (HF's Llama: 3 B parameters corrected,
    10 GB coming back) about 0.88: the triggered estimate at the rate alone was 9% under the measured step (RESULTS,
    session 21)."""
    if not host_elems or not back_bytes or not rate:
        return 1.0
    window = max(back_bytes / rates.h2d_bw, host_elems / rate)
    return host_adam_share(rate, "fp32", back_bytes / window)


DEVICE_RESTORE_BYTES = 16    # a replay's master restore (adam_undo part "param"): reads master and moments, writes it


def not_started(host: list[int], adam_at: dict[int, int], layout: Layout, adam_hidden: float,
                host_adam_rate: float) -> set[int]:
    """The host chunks whose speculative update the worker has not started at the verdict: the last ones it runs
    (backward's order) whose updates all fit in the `adam_hidden` seconds of host Adam an untriggered step leaves
    running into the next forward. A correction finds them queued and they apply the verdict's coefficient
    themselves (runtime/undo.py `correct`): nothing to undo or redo."""
    if not host_adam_rate:
        return set()
    left, out = adam_hidden, set()
    for c in sorted(host, key=adam_at.__getitem__, reverse=True):     # the last updated first
        left -= layout.chunks[c].used_elems / host_adam_rate
        if left < 0:
            break
        out.add(c)
    return out


def _triggered_seconds(transaction: str, step_seconds: float, *, cuda: bool, placement: list[str], layout: Layout,
                       node_secs: list[float], reads: list[set[int]], adam_at: dict[int, int], rates: Rates,
                       itemsize: int, copy_s: dict[int, float], kept_on_device: int, copies_exposed: float,
                       adam_hidden: float, replay_host_exposed: float = 0.0, host_adam_rate: float = 0.0) -> float:
    """The step's seconds when clipping triggers (global norm > grad_clip), as the runtime corrects it
    (runtime/transactions.py, undo.py). Only kept_grads and replay correct after the verdict; deferred, accumulate
    and none apply after it or not at all, and a two_pass step that measures first already counts its second pass:
    `step_seconds`. The device's own Adam is not in the estimate (rt.adam nodes cost nothing in node_seconds), so a
    device chunk's correction is priced by its bytes at the memory bandwidth (`device_correction_bytes`).

    kept_grads, on the CUDA runtime: at the verdict the host corrections are queued on the worker, in the order the
    next forward reads the chunks (chunk order), behind the host Adam the untriggered step hid behind the next
    forward (`adam_hidden`: the worker is still busy with it); the host updates not yet started then apply the
    verdict's coefficient themselves and need none (`not_started`); the launching thread then queues the device
    corrections without waiting: `kept_on_device` of the device chunks (the first ones) read their kept gradient on
    the device, the others' come back from the host on the copy stream; they run beside the next forward, which
    they slow by D (`device_after_verdict_seconds`); it stalls where it reads a host chunk not yet corrected and copied
    (`host_adam.worker_stall`, at `host_correction` parameters/s, slowed by the kept gradients coming back through
    host memory meanwhile: `host_correction_share`):
      triggered = step_seconds + D + host stall
    On the CPU runtime every job is inline, a "device" chunk's too (the C++ kernel on CPU memory):
      triggered = step_seconds + every updated chunk's elems / host_correction
    replay: the step runs again: the correction first waits for every host update of the step (the masters are
    restored from the moments those updates wrote), so `adam_hidden` is exposed; then the masters are restored
    (device chunks: DEVICE_RESTORE_BYTES per element at mem_bw, serial; host chunks on the worker, priced at the
    correction's rate: an upper bound, the restore does half its arithmetic over 16 of its 28 B), then one more
    forward+backward with its exposed copies, and its host jobs (each chunk's moments undone and the update redone:
    the correction's kernel) exposed as the host Adam's pipeline would be at host_correction
    (`replay_host_exposed`):
      triggered = step_seconds + adam_hidden + restore + sum(node_secs) + copies_exposed + replay_host_exposed
    The replayed pass's host jobs queue on the one worker behind the restores the forward did not wait for, which
    this does not count: a lower bound where host work dominates (GPT3_18B on the H200, RESULTS "the step as a
    transaction", 2026-12-01: 8.6 s of host work on one worker in a replayed step). Data-parallel plans: rank 0's
    chunks; the collectives' floor on the step is not applied to the second pass."""
    if transaction not in ("kept_grads", "replay"):
        return step_seconds
    undo = rates.host_correction
    updated = sorted(adam_at)                      # chunk order: the order the next forward reads them
    elems = lambda cs: sum(layout.chunks[c].used_elems for c in cs)  # noqa: E731
    device = [c for c in updated if placement[c] == "device"]
    host = [c for c in updated if placement[c] == "host"]
    again = sum(node_secs) + copies_exposed + replay_host_exposed if transaction == "replay" else 0.0
    if not cuda:
        return step_seconds + elems(device + host) / undo + again
    if transaction == "kept_grads":
        host = [c for c in host if c not in not_started(host, adam_at, layout, adam_hidden, host_adam_rate)]
        here = kept_here(device, kept_on_device)
        back = [c for c in device if c not in here]        # their kept gradients come back from the host
        undo *= host_correction_share(undo, elems(host), elems(back) * itemsize, rates)
        device_s = device_after_verdict_seconds(here, back, layout, node_secs, reads, itemsize, rates)
        return step_seconds + device_s + worker_stall(host, layout, node_secs, reads, undo, copy_s,
                                                      worker_start=adam_hidden, forward_start=device_s)
    device_s = elems(device) * DEVICE_RESTORE_BYTES / rates.mem_bw
    # the restores in update order (runtime/undo.py): the forward's first host chunk is about the last one done
    by_update = [c for c in sorted(adam_at, key=adam_at.__getitem__) if placement[c] == "host"]
    host_s = worker_stall(by_update, layout, node_secs, reads, undo, copy_s, forward_start=device_s)
    return step_seconds + adam_hidden + device_s + host_s + again
