"""movers: compute copies into device slots and gradients out of them — one Mover, two kinds of copy.

`Mover` does what the lowered graph's chunk nodes ask:

  prefetch(c)  take a compute slot and start bringing chunk c's compute copy into it: a cast on the device
               for a device chunk; for a host chunk its 16-bit shadow (2 B/param cross), a cast on the host
               into staging (2 B/param), or the fp32 master (4 B/param) cast on the device from staging;
               for a frozen host chunk its weights as they are (already in the compute dtype);
               with chunk-partitioned data parallelism only c's owner does that, then broadcasts the slot;
               (nothing, for a chunk whose compute copy stays on the device between steps: an fp32 device
               chunk's master, a frozen device chunk's weights, or the 16-bit copy its updates keep current,
               plan.keeps_compute_copies);
               a host chunk whose update still runs on the worker: the copy is started there as the update
               ends (`CopyAfter`), so the launching thread goes on queueing compute;
  fetch(c)     the compute waits until that copy has landed (prefetching first if the plan did not);
  release(c)   the slot is free once its last reader has run;
  param(i)     parameter i as a view of its chunk's compute copy;
  grad(i, g)   parameter i's gradient into its chunk's gradient slot;
  ship(c, dst) a chunk's gradient slot copied into a host buffer (a host chunk's offload, or a kept copy).

What differs between a CPU playing the device tier and a GPU is only how copies are ordered: `CpuCopies`
runs every copy at once; `CudaCopies` puts them on a host->device and a device->host stream (and the work
after a verdict, with the kept gradients it brings back, on two more: `Mover.after_verdict`; with
the casts of chunks crossing as fp32 on a fifth: `copy_in_pieces`) and orders every
cross-stream use by an explicit event (no `record_stream`, but for gradients kept in the activations' memory:
`free_after`; every other buffer comes from a pool allocated once), with
timing events around each wait of the compute stream.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import Future

import torch

from ..config import parse_flag
from ..planning import Plan
from ..planning.memory import copy_staging_elems
from .store import ChunkStore, Pool
from .telemetry import Telemetry


def cast_stream() -> bool:
    """PSTAR_FX_CAST_STREAM (default 1; 0: each cast on the copy stream, behind its piece's copy): the casts of a
    chunk crossing as fp32 run on a stream of their own (`copy_in_pieces`). Measured on an H100 box (GPT3_18B, bf16
    moments, 51 host chunks crossing as fp32 in a `two_pass` step; bench/RESULTS.md, session 32): the compute waited
    0.68 s a step for copies and casts against 1.05 s with the casts on the copy stream, steps 7.65-7.91 s against
    8.00-8.03."""
    return parse_flag(os.environ.get("PSTAR_FX_CAST_STREAM", "1"), "PSTAR_FX_CAST_STREAM")


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor, copies,
                   cast_done: list | None = None):
    """fp32 `src` (host) into 16-bit `dst` (device) through the fp32 `staging` buffer, piece by piece, queued on the
    current stream (the copy stream).

    `cast_done` None: each piece crosses into `staging` and is cast into `dst` on the current stream, so the next
    piece's copy waits for that cast, and a cast waits for SMs that the compute stream's kernels hold. Every copy
    queued behind it waits too: at GPT3_18B on an H100 box the compute waited 1.05 s a step for copies so queued,
    0.68 s with the casts on their own stream (bench/RESULTS.md, session 32). Returns None: the current stream's next
    event covers it all.

    `cast_done`, two events (None at first; one per half of `staging`, updated here): each piece crosses into a half
    on the current stream once that half's last cast has read it, and is cast on the "cast" stream, so the copy
    engine fills one half while the other waits for its cast. The buffer is the same, the pieces are half as large.
    Returns the last cast's event: what a reader of `dst` waits for (each cast waited for its piece's copy, and the
    casts run in order on their stream)."""
    n = dst.numel()
    if cast_done is None or staging.numel() < 2:
        piece = staging.numel()
        for a in range(0, n, piece):
            b = min(a + piece, n)
            staging[: b - a].copy_(src[a:b], non_blocking=True)
            dst[a:b].copy_(staging[: b - a])
        return None
    half = staging.numel() // 2
    halves = (staging[:half], staging[half: 2 * half])
    last = None
    for i, a in enumerate(range(0, n, half)):
        b, h = min(a + half, n), i % 2
        buf = halves[h][: b - a]
        copies.wait(cast_done[h])                   # the half's last cast has read it
        buf.copy_(src[a:b], non_blocking=True)
        copied = copies.record()
        with copies.on("cast"):
            copies.wait(copied)
            dst[a:b].copy_(buf)
            cast_done[h] = last = copies.record()
    return last


class CpuCopies:
    """The CPU as the device tier: every copy is synchronous, so there is nothing to order."""

    def on(self, stream: str):
        return contextlib.nullcontext()

    def record(self):
        return None

    def wait(self, event) -> None:
        """The current stream waits for `event`."""

    def compute_waits(self, event) -> None:
        """The compute stream waits for `event` (a copy; a collective, which is waited for here)."""
        if event is not None:
            event.wait()

    def host_waits(self, event) -> None:
        """The calling host thread waits for `event`."""

    def landed(self, event) -> bool:
        """Whether `event` has happened (a host thread would not wait for it)."""
        return True

    def back_after_copies_out(self) -> None:
        """Kept gradients brought back from now on (`Mover.bring_back`) come after every copy to the host queued so
        far."""

    def start_step(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def free_after(self, t: torch.Tensor, stream: str) -> None:
        """`t` is dropped now; its memory may be reused once `stream`'s work queued so far has run."""


class CudaCopies:
    def __init__(self, device: torch.device, telemetry: Telemetry):
        _expandable_segments()
        if os.environ.get("TRITON_INTERPRET") == "1":
            warnings.warn("TRITON_INTERPRET=1 is set: the GPU Adam and casts will run in Triton's Python "
                          "interpreter, orders of magnitude slower; unset it for GPU training", RuntimeWarning)
        self.device, self.telemetry = device, telemetry
        self.compute = torch.cuda.current_stream(device)
        # "late": device chunks' work after the verdict (corrections, a deferred step's updates: Mover.after_verdict);
        # "back": their kept gradients coming back from the host (on "h2d" the next forward's copies in, which are
        # device-to-device casts for device chunks, would queue behind them all)
        # "cast": the casts of chunks crossing as fp32 (`copy_in_pieces`; PSTAR_FX_CAST_STREAM=0: none)
        self.streams = {name: torch.cuda.Stream(device) for name in ("h2d", "d2h", "late", "back", "cast")}
        telemetry.mark = self._mark     # the launching thread's host waits read against the compute stream

    def _mark(self) -> torch.cuda.Event:
        """A timing event recorded on the compute stream now."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.compute)
        return ev

    def on(self, stream: str):
        return torch.cuda.stream(self.streams[stream])

    def record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def compute_waits(self, event) -> None:
        if event is None:
            return
        before = self._mark()
        if isinstance(event, torch.cuda.Event):
            self.compute.wait_event(event)
        else:                                    # a collective (dist.Pending): the current stream waits for it
            with torch.cuda.stream(self.compute):
                event.wait()
        self.telemetry.stall(before, self._mark())

    def host_waits(self, event) -> None:
        if event is not None:
            event.synchronize()

    def free_after(self, t: torch.Tensor, stream: str) -> None:
        # the one buffer not from a pool allocated once (KeptGradients.release): the caching allocator holds its
        # block until `stream` has run what it queued so far
        t.record_stream(self.streams[stream])

    def landed(self, event) -> bool:
        query = getattr(event, "query", None)
        return query is None or query()

    def back_after_copies_out(self) -> None:
        self.streams["back"].wait_stream(self.streams["d2h"])

    def start_step(self) -> None:
        """Copies of this step may read masters the compute stream updated in the last one."""
        self.telemetry.count_stalls()
        self.streams["h2d"].wait_stream(self.compute)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class CopyAfter:
    """A compute copy that must wait for a host chunk's update on the worker: `start` (which queues the copy on
    the copy stream and returns its event) runs on the thread that finishes the update, as it finishes. Before,
    the launching thread waited for the update at the prefetch, and every kernel it would have queued after it
    waited too: at 18B with bf16 moments the GPU idled while the host Adam ran after the verdict."""

    def __init__(self, update: Future, start):
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._start, self._event, self._error, self._cancelled = start, None, None, False
        update.add_done_callback(self._run)      # at once, on this thread, if the update has finished

    def _run(self, update: Future) -> None:
        with self._lock:
            try:
                # a failed update leaves no copy to make: the fetch raises its error first (`wait_for`)
                if not self._cancelled and not update.cancelled() and update.exception() is None:
                    self._event = self._start()
            except BaseException as e:  # noqa: BLE001 - raised on the launching thread, by `event`
                self._error = e
            finally:
                self._started.set()

    def event(self):
        """The copy's event, once it was queued (its update has finished by now: the fetch waited for it); None
        for a copy cancelled before it was queued, which never will be."""
        with self._lock:
            if self._cancelled and not self._started.is_set():
                return None
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self._event

    def cancel(self) -> None:
        """A failed step gives the slot back: a copy not yet queued is not queued (one queued is on the copy
        stream, before any later use of the slot)."""
        with self._lock:
            self._cancelled = True


class Mover:
    def __init__(self, store: ChunkStore, plan: Plan, copies, telemetry: Telemetry, dp=None):
        self.store, self.plan, self.copies, self.stats = store, plan, copies, telemetry.stats
        self.dp = dp if dp is not None and dp.chunked else None   # runtime.dist.DataParallel, partitioned
        layout, dtype, cs = store.layout, store.compute_dtype, store.layout.chunk_size
        self.layout = layout
        # a device chunk with a 16-bit copy on the device (plan.keeps_compute_copies) computes on it: no slot
        resident = {c: t for c, t in store.shadow.items() if plan.placement[c] == "device"}
        self.slots = Pool([store.alloc("device", cs, dtype) for _ in range(plan.slots - len(resident))])
        # a gradient slot holds a trainable chunk's gradient: as long as its state (Layout.state_elems)
        self.grad_slots = Pool([store.alloc("device", layout.state_elems, dtype) for _ in range(plan.grad_slots)],
                               fifo=True)
        self._staging = (store.alloc("device", copy_staging_elems(cs), torch.float32)
                         if "fp32" in plan.ship and dtype != torch.float32 else None)
        self._cast_done = [None, None] if cast_stream() else None   # `copy_in_pieces`: each half's last cast
        self._host_cast = store.alloc("host", cs, dtype) if "cast" in plan.ship else None
        self.compute: dict[int, torch.Tensor] = {}   # chunk -> its compute buffer, while resident
        self.grads: dict[int, torch.Tensor] = {}     # chunk -> its gradient slot, from first gradient to hand-over
        self._ready: dict[int, object] = {}          # chunk -> its copy-in event
        self._slot_done: dict[int, object] = {}      # slot data_ptr -> its last reader finished
        self._grad_done: dict[int, object] = {}      # gradient slot data_ptr -> its last copy out finished
        self._grad_read: dict[int, object] = {}      # gradient slot data_ptr -> its last reader (`read_back_done`)
        self._late: dict[int, object] = {}           # device chunk -> its work after the last verdict (`after_verdict`)
        self._late_done = None                       # every such work queued so far
        self.pinned = {c for c in range(len(layout.chunks)) if plan.placement[c] == "device" and self.dp is None
                       and (dtype == torch.float32 or layout.chunks[c].frozen)}
        for c in self.pinned:
            self.compute[c] = store.master[c]        # fp32 on the device, or frozen: the master is the compute copy
        self.pinned |= set(resident)
        self.compute.update(resident)

    # ---- compute copies ------------------------------------------------------------------------------
    def prefetch(self, c: int, after: Future | None = None) -> None:
        """`after`: chunk c's host update still running on the worker (the copy reads what it writes). The copy
        then starts as it finishes, when it reads one buffer alone (`copies_alone`); otherwise the runtime
        waited for the update before calling this."""
        if c in self.pinned:                         # its compute copy is always there and current
            return
        buf = self.slots.take()
        n = self.layout.chunks[c].used_elems
        slot_free = self._slot_done.pop(buf.data_ptr(), None)
        if after is not None:
            assert self.copies_alone(c), c
            self._count_in(c, n)
            self._ready[c] = CopyAfter(after, lambda: self._start_copy(c, buf[:n], slot_free))
        elif self.dp is None:
            if self.store.holds(c):
                self._count_in(c, n)
            self._ready[c] = self._start_copy(c, buf[:n], slot_free)
        else:                                    # from the owner's slot into every rank's (after the copy in)
            with self.copies.on("h2d"):
                self.copies.wait(slot_free)
                self.copies.wait(self._late.pop(c, None))
                if self.store.holds(c):
                    self._count_in(c, n)
                    self.copies.wait(self._copy_in(c, buf[:n]))      # (its casts, where they ran apart)
                self._ready[c] = self.dp.broadcast_chunk(buf[:n], c)
                self.stats.coll_bytes += n * buf.element_size()
        self.compute[c] = buf

    def copies_alone(self, c: int) -> bool:
        """Whether chunk c's copy in can start on another thread: it reads its shadow or master straight
        into the slot, with no staging buffer that the copies of other chunks share (and no broadcast, which
        every rank must start in the same order)."""
        how = self.plan.ship[c]
        return self.dp is None and (how in ("shadow", "frozen") or (how == "fp32" and self._staging is None))

    def _start_copy(self, c: int, dst: torch.Tensor, slot_free):
        """Queue chunk c's copy into `dst` on the copy stream, after the slot's last reader; returns its event."""
        with self.copies.on("h2d"):
            self.copies.wait(slot_free)
            self.copies.wait(self._late.pop(c, None))          # it reads the state the verdict's work writes
            cast = self._copy_in(c, dst) if self.store.holds(c) else None
            return cast if cast is not None else self.copies.record()

    def _count_in(self, c: int, n: int) -> None:
        """(Counted on the launching thread: a copy started on the worker must not race the count.)"""
        how = self.plan.ship[c]
        if how != "-":
            self.stats.h2d_bytes += n * (4 if how == "fp32" else self.store.compute_dtype.itemsize)

    def _copy_in(self, c: int, dst: torch.Tensor):
        """Queue chunk c's compute copy into `dst` on the current stream; returns the event of its last cast where
        that ran on a stream of its own (`copy_in_pieces`), else None."""
        store = self.store
        # the slot holds any chunk; a trainable chunk's state may be shorter (Layout.state_elems): its tail is
        # no parameter's
        n = min(dst.numel(), store.master[c].numel())
        dst, src = dst[:n], store.master[c][:n]
        how = self.plan.ship[c]
        if how == "-":
            dst.copy_(src)                                      # cast on the device
            return None
        if how == "shadow":
            dst.copy_(store.shadow[c][:n], non_blocking=True)   # the host Adam already wrote the 16-bit copy
        elif how == "frozen":
            dst.copy_(src, non_blocking=True)                   # frozen weights are in the compute dtype
        elif how == "cast":
            self._host_cast[:n].copy_(src)                      # cast on the host, ship 16 bits
            dst.copy_(self._host_cast[:n], non_blocking=True)
        elif self._staging is not None:                         # ship fp32, cast on the device, piece by piece
            return copy_in_pieces(dst, src, self._staging, self.copies, self._cast_done)
        else:
            dst.copy_(src, non_blocking=True)
        return None

    def fetch(self, c: int) -> None:
        if c not in self.compute:
            self.prefetch(c)
        ready = self._ready.pop(c, None)
        if isinstance(ready, CopyAfter):
            ready = ready.event()
        self.copies.compute_waits(ready)

    def release(self, c: int) -> None:
        if c in self.pinned:
            return
        buf = self.compute.pop(c)
        unread = self._ready.pop(c, None)
        if isinstance(unread, CopyAfter):
            # prefetched, never fetched: its copy may not yet be queued, so the copy stream's order alone would
            # not keep it before the slot's next copy; the slot is free once it has landed
            self.copies.wait(unread.event())
        elif unread is not None and self._cast_done is not None:
            # (its last writes may be casts on their own stream, which the copy stream's order does not hold back)
            self.copies.wait(unread)
        self._slot_done[buf.data_ptr()] = self.copies.record()
        self.slots.give(buf)

    def param(self, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        if self._late:                           # a resident compute copy the verdict's work may still write
            self.copies.compute_waits(self._late.pop(slot.chunk, None))
        buf = self.compute.get(slot.chunk)
        if buf is None:
            raise RuntimeError(f"chunk {slot.chunk} (holding {slot.param.name}) is not resident: schedule bug")
        return buf[slot.offset: slot.offset + slot.numel].view(slot.param.shape)

    # ---- gradients -----------------------------------------------------------------------------------
    def grad(self, index: int, g: torch.Tensor) -> None:
        self._grad_span(index).copy_(g.reshape(-1))

    def grad_mm(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        torch.mm(a, b, out=self._grad_span(index).view(a.shape[0], b.shape[1]))

    def _grad_span(self, index: int) -> torch.Tensor:
        """Parameter `index`'s elements of its chunk's gradient slot (taking a slot at the chunk's first)."""
        slot = self.layout.slots[index]
        buf = self.grads.get(slot.chunk)
        if buf is None:
            buf = self.grads[slot.chunk] = self.grad_slots.take()
            self.copies.compute_waits(self._grad_done.pop(buf.data_ptr(), None))   # its last copy out is done
            self.join_late()     # backward's updates write the state, and its gradients the slots, that work used
        return buf[slot.offset: slot.offset + slot.numel]

    def hand_over(self, c: int) -> torch.Tensor:
        """Chunk c's gradient slot, for its update on the device; `give_back` returns it."""
        return self.grads.pop(c)

    def give_back(self, buf: torch.Tensor) -> None:
        self.grad_slots.give(buf)

    def bring_back(self, src: torch.Tensor, n: int):
        """A kept gradient `src[:n]` on the host copied into a gradient slot on a copy stream of its own, after the
        slot's last reader on the current stream; returns (slot, the copy's event). The launching thread does not
        wait: the stream that reads the slot waits for the event, and `read_back_done` gives the slot back."""
        buf = self.grad_slots.take()
        after = self._grad_read.pop(buf.data_ptr(), None) or self.copies.record()   # every compute use so far
        with self.copies.on("back"):
            self.copies.wait(after)
            self.copies.wait(self._grad_done.get(buf.data_ptr()))                   # a copy out of it
            buf[:n].copy_(src[:n], non_blocking=True)
            copied = self.copies.record()
        return buf, copied

    def read_back_done(self, buf: torch.Tensor) -> None:
        """The kernels queued so far on the current stream are the last readers of `buf` (a slot `bring_back`
        filled): it goes back to the pool, and the next copy into it waits for them (backward's next use of it,
        for all of them: `join_late`)."""
        self._grad_read[buf.data_ptr()] = self.copies.record()
        self.grad_slots.give(buf)

    def ship(self, buf: torch.Tensor, dst: torch.Tensor, n: int, also=None):
        """Copy `buf[:n]` (a gradient slot) into host `dst` after the compute stream's work so far, and `also`
        ((device source, host target), a small flag) with it; returns the copy's event. The slot may be reused
        once that event has passed (`grad` waits for it)."""
        written = self.copies.record()
        with self.copies.on("d2h"):
            self.copies.wait(written)
            dst[:n].copy_(buf[:n], non_blocking=True)
            if also is not None:
                also[1].copy_(also[0], non_blocking=True)
            copied = self.copies.record()
        self.stats.d2h_bytes += n * buf.element_size()
        self._grad_done[buf.data_ptr()] = copied
        return copied

    def offload(self, c: int, dst: torch.Tensor, also=None):
        """A host chunk's gradients go to the host buffer `dst` (with `also`, see `ship`); returns the copy's event."""
        buf = self.grads.pop(c)
        copied = self.ship(buf, dst, self.layout.chunks[c].used_elems, also)
        self.grad_slots.give(buf)
        return copied

    # ---- device work after the verdict --------------------------------------------------------------
    @contextlib.contextmanager
    def after_verdict(self):
        """Device chunks' work after the verdict (a correction's, a deferred step's updates), queued inside this
        block, runs on its own stream after everything the compute stream queued so far; the caller calls the
        function it yields with each chunk once that chunk's kernel is queued. The next forward starts at once
        and waits only where it reads such a chunk (its copy in or a resident copy's first view), and backward's
        first gradient waits for all of it: at Llama-3-8B's shape the compute stream waited 0.17 s a triggered
        step for the kept gradients coming back before it could start the next forward (issue 24)."""
        def queued(c: int) -> None:
            self._late[c] = self.copies.record()

        start = self.copies.record()
        with self.copies.on("late"):
            self.copies.wait(start)
            try:
                yield queued
            finally:
                self._late_done = self.copies.record()

    def join_late(self) -> None:
        """The current stream waits for all the device work after the verdict (`after_verdict`) queued so far."""
        if self._late_done is not None:
            self.copies.wait(self._late_done)
            self._late_done = None

    # ---- the end of a step ---------------------------------------------------------------------------
    def clear(self) -> None:
        """After a step that failed midway: every compute slot and gradient slot back to its pool."""
        for ready in self._ready.values():
            if isinstance(ready, CopyAfter):     # a copy waiting for its update: not into a slot given back
                ready.cancel()
            elif hasattr(ready, "abandon"):      # a broadcast (dist.Pending) still writing into a slot given back
                ready.abandon()
        for c in [c for c in self.compute if c not in self.pinned]:
            self.release(c)
        for buf in self.grads.values():
            self.grad_slots.give(buf)
        self.grads.clear()
        self._ready.clear()

    def check_idle(self) -> None:
        left = set(self.compute) - self.pinned
        if left or self.grads:
            raise RuntimeError(f"step ended with chunks still resident {sorted(left)} or gradients pending "
                               f"{sorted(self.grads)}: schedule bug")


def _expandable_segments() -> None:
    """Let the CUDA caching allocator grow segments in place, unless the user configured it.

    The plan fills the GPU to within a small margin. With fixed-size segments, activations of many
    sizes fragment the cache: an 18B step that the plan put at 138.9 of 139.3 GiB (and the allocator
    measured at 137.2 GiB) failed in its second step to find 3.07 GiB contiguous with 4.7 GiB free in
    pieces. Expandable segments map physical pages into one growing range, so free memory stays usable.
    """
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:True")
    except Exception as e:  # noqa: BLE001 - an allocator that cannot: the plan's margin must do
        warnings.warn(f"could not enable expandable CUDA segments ({e}); large plans may fail to fragmentation",
                      RuntimeWarning)
