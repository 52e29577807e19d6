"""movers: compute copies into device slots and gradients out of them — one Mover, two kinds of copy.

`Mover` does what the lowered graph's chunk nodes ask:

  prefetch(c)  take a compute slot and start bringing chunk c's compute copy into it: a cast on the device
               for a device chunk; for a host chunk its 16-bit shadow (2 B/param cross), a cast on the host
               into staging (2 B/param), or the fp32 master (4 B/param) cast on the device from staging;
               with chunk-partitioned data parallelism only c's owner does that, then broadcasts the slot;
               (nothing, for a chunk whose compute copy stays on the device between steps: an fp32 device
               chunk's master, or the 16-bit copy its updates keep current, plan.keeps_compute_copies);
  fetch(c)     the compute waits until that copy has landed (prefetching first if the plan did not);
  release(c)   the slot is free once its last reader has run;
  param(i)     parameter i as a view of its chunk's compute copy;
  grad(i, g)   parameter i's gradient into its chunk's gradient slot;
  ship(c, dst) a chunk's gradient slot copied into a host buffer (a host chunk's offload, or a kept copy).

What differs between a CPU playing the device tier and a GPU is only how copies are ordered: `CpuCopies`
runs every copy at once; `CudaCopies` puts them on a host->device and a device->host stream and orders
every cross-stream use by an explicit event (no `record_stream`; all buffers come from pools allocated
once), with timing events around each wait of the compute stream.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from ..plan import Plan
from .store import ChunkStore, Pool
from .telemetry import Telemetry


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

    def start_step(self) -> None:
        pass

    def sync(self) -> None:
        pass


class CudaCopies:
    def __init__(self, device: torch.device, telemetry: Telemetry):
        _expandable_segments()
        if os.environ.get("TRITON_INTERPRET") == "1":
            warnings.warn("TRITON_INTERPRET=1 is set: the GPU Adam and casts will run in Triton's Python "
                          "interpreter, orders of magnitude slower; unset it for GPU training", RuntimeWarning)
        self.device, self.telemetry = device, telemetry
        self.compute = torch.cuda.current_stream(device)
        self.streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}

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
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(self.compute)
        if isinstance(event, torch.cuda.Event):
            self.compute.wait_event(event)
        else:                                    # a collective (dist.Pending): the current stream waits for it
            with torch.cuda.stream(self.compute):
                event.wait()
        after.record(self.compute)
        self.telemetry.stall(before, after)

    def host_waits(self, event) -> None:
        if event is not None:
            event.synchronize()

    def start_step(self) -> None:
        """Copies of this step may read masters the compute stream updated in the last one."""
        self.telemetry.count_stalls()
        self.streams["h2d"].wait_stream(self.compute)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class Mover:
    def __init__(self, store: ChunkStore, plan: Plan, copies, telemetry: Telemetry, dp=None):
        self.store, self.plan, self.copies, self.stats = store, plan, copies, telemetry.stats
        self.dp = dp if dp is not None and dp.chunked else None   # runtime.dist.DataParallel, partitioned
        layout, dtype, cs = store.layout, store.compute_dtype, store.layout.chunk_size
        self.layout = layout
        # a device chunk with a 16-bit copy on the device (plan.keeps_compute_copies) computes on it: no slot
        resident = {c: t for c, t in store.shadow.items() if plan.placement[c] == "device"}
        self.slots = Pool([store.alloc("device", cs, dtype) for _ in range(plan.slots - len(resident))])
        self.grad_slots = Pool([store.alloc("device", cs, dtype) for _ in range(plan.grad_slots)])
        self._staging = (store.alloc("device", cs, torch.float32)
                         if "fp32" in plan.ship and dtype != torch.float32 else None)
        self._host_cast = store.alloc("host", cs, dtype) if "cast" in plan.ship else None
        self.compute: dict[int, torch.Tensor] = {}   # chunk -> its compute buffer, while resident
        self.grads: dict[int, torch.Tensor] = {}     # chunk -> its gradient slot, from first gradient to hand-over
        self._ready: dict[int, object] = {}          # chunk -> its copy-in event
        self._slot_done: dict[int, object] = {}      # slot data_ptr -> its last reader finished
        self._grad_done: dict[int, object] = {}      # gradient slot data_ptr -> its last copy out finished
        self.pinned = {c for c in range(len(layout.chunks))
                       if plan.placement[c] == "device" and dtype == torch.float32 and self.dp is None}
        for c in self.pinned:
            self.compute[c] = store.master[c]        # fp32 on the device: the master is the compute copy
        self.pinned |= set(resident)
        self.compute.update(resident)

    # ---- compute copies ------------------------------------------------------------------------------
    def prefetch(self, c: int) -> None:
        """(The runtime first waits for chunk c's pending host update: the copy reads its master.)"""
        if c in self.pinned:                         # its compute copy is always there and current
            return
        buf = self.slots.take()
        n = self.layout.chunks[c].used_elems
        with self.copies.on("h2d"):
            self.copies.wait(self._slot_done.pop(buf.data_ptr(), None))
            if self.store.holds(c):
                self._copy_in(c, buf[:n])
            if self.dp is None:
                self._ready[c] = self.copies.record()
            else:                                # from the owner's slot into every rank's (after the copy in)
                self._ready[c] = self.dp.broadcast_chunk(buf[:n], c)
                self.stats.coll_bytes += n * buf.element_size()
        self.compute[c] = buf

    def _copy_in(self, c: int, dst: torch.Tensor) -> None:
        n, store = dst.numel(), self.store
        src = store.master[c][:n]
        how = self.plan.ship[c]
        if how == "-":
            dst.copy_(src)                                      # cast on the device
            return
        if how == "shadow":
            dst.copy_(store.shadow[c][:n], non_blocking=True)   # the host Adam already wrote the 16-bit copy
        elif how == "cast":
            self._host_cast[:n].copy_(src)                      # cast on the host, ship 16 bits
            dst.copy_(self._host_cast[:n], non_blocking=True)
        elif self._staging is not None:
            self._staging[:n].copy_(src, non_blocking=True)     # ship fp32, cast on the device
            dst.copy_(self._staging[:n])
        else:
            dst.copy_(src, non_blocking=True)
        self.stats.h2d_bytes += n * (4 if how == "fp32" else dst.element_size())

    def fetch(self, c: int) -> None:
        if c not in self.compute:
            self.prefetch(c)
        self.copies.compute_waits(self._ready.pop(c, None))

    def release(self, c: int) -> None:
        if c in self.pinned:
            return
        buf = self.compute.pop(c)
        self._slot_done[buf.data_ptr()] = self.copies.record()
        self.slots.give(buf)

    def param(self, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
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
        return buf[slot.offset: slot.offset + slot.numel]

    def hand_over(self, c: int) -> torch.Tensor:
        """Chunk c's gradient slot, for its update on the device; `give_back` returns it."""
        return self.grads.pop(c)

    def give_back(self, buf: torch.Tensor) -> None:
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

    # ---- the end of a step ---------------------------------------------------------------------------
    def clear(self) -> None:
        """After a step that failed midway: every compute slot and gradient slot back to its pool."""
        for c in [c for c in self.compute if c not in self.pinned]:
            self.release(c)
        for buf in self.grads.values():
            self.grad_slots.give(buf)
        self.grads.clear()
        for ready in self._ready.values():
            if hasattr(ready, "abandon"):        # a broadcast (dist.Pending) still writing into a slot given back
                ready.abandon()
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
