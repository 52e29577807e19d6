"""runtime_cuda: the chunk runtime on a GPU — copy streams, events, and the host Adam on a worker thread.

Same `rt` methods as runtime.ChunkRuntime (the lowered graph does not change), but asynchronous:

  prefetch(c)  on the host->device stream: wait until the slot's previous chunk was released by the
               compute stream, copy the fp32 master (pinned) into a device staging buffer and cast it into
               the slot there (4 B/param over PCIe, the cast at HBM speed); or cast on the device for a
               device-resident chunk. Records an event.
  fetch(c)     the compute stream waits for that event (prefetching first if the plan did not).
  release(c)   records on the compute stream when the slot's last reader ran; the slot's next copy waits.
  offload(c)   on the device->host stream, after the chunk's last gradient: gradients into a pinned host
               buffer (as many as the plan says: gradients queue there while the host Adam catches up).
  adam(c)      host chunk: the C++ Adam on a worker thread (it releases the GIL) once the gradient copy has
               landed, while the GPU goes on with backward and into the next step's forward; device
               chunk: the Triton Adam on the compute stream, with no host sync (a non-finite gradient sets
               a flag instead).
  finish()     end of step: does not wait for the worker. The next step's prefetch of a host chunk waits
               for that chunk's update alone, so host Adam overlaps the next forward up to that chunk;
               `drain()` waits for all of it (state_dict does).

No `record_stream`: every cross-stream use is ordered by an explicit event, and all buffers come from
pools allocated once.
"""
from __future__ import annotations

import os
import queue
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .optim import chunk_update
from .runtime import ChunkRuntime


class CudaChunkRuntime(ChunkRuntime):
    def __init__(self, layout, plan, config, device, compute_dtype):
        _expandable_segments()
        super().__init__(layout, plan, config, device, compute_dtype)
        if os.environ.get("TRITON_INTERPRET") == "1":
            warnings.warn("TRITON_INTERPRET=1 is set: the GPU Adam and casts will run in Triton's Python "
                          "interpreter, orders of magnitude slower; unset it for GPU training", RuntimeWarning)
        cs = layout.chunk_size
        self.compute_stream = torch.cuda.current_stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._ready: dict[int, torch.cuda.Event] = {}
        self._slot_done: dict[int, torch.cuda.Event] = {}       # slot data_ptr -> last reader finished
        self._grad_done: dict[int, torch.cuda.Event] = {}       # grad slot data_ptr -> d2h copy finished
        any_host = "host" in plan.placement
        self._staging = (self._alloc(True, cs, torch.float32)
                         if "fp32" in plan.ship and compute_dtype != torch.float32 else None)
        self._host_grads: queue.Queue = queue.Queue()
        if any_host:
            self._host_grads.put(self._host_grad)
            for _ in range(plan.host_grad_buffers - 1):     # as many as the plan's Adam pipeline needs
                self._host_grads.put(self._alloc(False, cs, compute_dtype))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pstar_fx-adam") if any_host else None
        self._updates: dict[int, Future] = {}   # host chunk -> its Adam on the worker (True: applied)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._seconds = {"compute_waits_for_copies": 0.0, "host_adam": 0.0, "wait_for_host_grad_buffer": 0.0,
                         "wait_for_host_adam": 0.0, "steps": 0}
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ---- compute copies ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start of step: copies may read masters the compute stream updated in the last step; the
        device chunks' non-finite flag starts clear."""
        super().begin()
        self._count_stalls()
        self.found_inf.zero_()
        self.h2d.wait_stream(self.compute_stream)

    def prefetch(self, c: int) -> None:
        if c in self._updates:
            self._await_update(c)                            # the master/shadow must be this step's
        buf = self._free_slots.pop()
        n = self.layout.chunks[c].used_elems
        with torch.cuda.stream(self.h2d):
            done = self._slot_done.pop(buf.data_ptr(), None)
            if done is not None:
                self.h2d.wait_event(done)
            src = self.master[c][:n]
            if self.plan.placement[c] == "device":
                buf[:n].copy_(src)
            elif c in self.shadow:
                buf[:n].copy_(self.shadow[c][:n], non_blocking=True)   # 16 bits cross
                self.stats.h2d_bytes += n * buf.element_size()
            elif self._staging is not None:
                self._staging[:n].copy_(src, non_blocking=True)
                buf[:n].copy_(self._staging[:n])            # cast on the device
                self.stats.h2d_bytes += n * 4
            else:
                buf[:n].copy_(src, non_blocking=True)
                self.stats.h2d_bytes += n * 4
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        self._ready[c] = ready
        self.compute[c] = buf

    def fetch(self, c: int) -> None:
        if c not in self.compute:
            self.prefetch(c)
        ready = self._ready.pop(c, None)
        if ready is not None:
            self._wait(ready)

    def release(self, c: int) -> None:
        buf = self.compute.pop(c)
        done = torch.cuda.Event()
        done.record(self.compute_stream)
        self._slot_done[buf.data_ptr()] = done
        self._free_slots.append(buf)

    # ---- gradients and the update ---------------------------------------------------------------------
    def grad(self, index: int, g: torch.Tensor) -> None:
        slot = self.layout.slots[index]
        buf = self.grads.get(slot.chunk)
        if buf is None:
            buf = self.grads[slot.chunk] = self._free_grads.pop()
            copied = self._grad_done.pop(buf.data_ptr(), None)
            if copied is not None:
                self._wait(copied)                          # its last gradients are on the host now
        buf[slot.offset: slot.offset + slot.numel].copy_(g.reshape(-1))

    def offload(self, c: int) -> None:
        buf = self.grads.pop(c)
        n = self.layout.chunks[c].used_elems
        t0 = time.perf_counter()
        host = self._host_grads.get()                       # blocks only if the host Adam is behind
        self._seconds["wait_for_host_grad_buffer"] += time.perf_counter() - t0
        written = torch.cuda.Event()
        written.record(self.compute_stream)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(written)
            host[:n].copy_(buf[:n], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.d2h)
        self.stats.d2h_bytes += n * buf.element_size()
        self._grad_done[buf.data_ptr()] = copied
        self._free_grads.append(buf)
        self.grads[c] = (host, copied)

    def adam(self, c: int) -> None:
        spans = self.layout.chunks[c].grad_spans()
        if self.plan.placement[c] == "host":
            host, copied = self.grads.pop(c)
            self._updates[c] = self._worker.submit(self._host_adam, c, host, copied, spans, self.step_count)
            return
        grad = self.grads.pop(c)
        chunk_update(self.master[c], grad, self.exp_avg[c], self.exp_avg_sq[c], spans, step=self.step_count,
                     hparams=self.hparams, found_inf=self.found_inf)
        self._free_grads.append(grad)

    def _host_adam(self, c, host, copied, spans, step) -> bool:
        try:
            copied.synchronize()
            t0 = time.perf_counter()
            applied = chunk_update(self.master[c], host, self.exp_avg[c], self.exp_avg_sq[c], spans, step=step,
                                   hparams=self.hparams, param_out=self.shadow.get(c))
            self._seconds["host_adam"] += time.perf_counter() - t0
            return applied
        finally:
            self._host_grads.put(host)

    def _await_update(self, c: int) -> None:
        """Wait for chunk c's host Adam; a skipped update counts in the step that waits for it."""
        t0 = time.perf_counter()
        applied = self._updates.pop(c).result()
        self._seconds["wait_for_host_adam"] += time.perf_counter() - t0
        if not applied:
            self.skipped_chunks += 1

    def drain(self) -> None:
        """Wait for every host Adam still running: the masters are then those of the last step."""
        for c in list(self._updates):
            self._await_update(c)

    def finish(self) -> None:
        for c in [c for c, f in self._updates.items() if f.done()]:
            self._await_update(c)                            # collect results (and errors) already in
        self._seconds["steps"] += 1
        if "device" in self.plan.placement and bool(self.found_inf.item()):   # one sync per step
            self.skipped_chunks += 1      # at least one device chunk, and every device chunk after it

    def _wait(self, event: torch.cuda.Event) -> None:
        """The compute stream waits for a copy; timing events on both sides measure how long it stalled."""
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(self.compute_stream)
        self.compute_stream.wait_event(event)
        after.record(self.compute_stream)
        self._stalls.append((before, after))

    def _count_stalls(self) -> None:
        """Add up the stalls whose events have completed (no sync: unfinished ones wait for later)."""
        pending = []
        for before, after in self._stalls:
            if after.query():
                self._seconds["compute_waits_for_copies"] += before.elapsed_time(after) / 1e3
            else:
                pending.append((before, after))
        self._stalls = pending

    def timing(self) -> dict:
        """Seconds per step: the compute stream stalled waiting for chunk copies; host Adam work (on the
        worker thread); how long the launching thread waited for a free host gradient buffer (Adam
        behind backward); and how long prefetches waited for a host chunk's update."""
        self.drain()
        torch.cuda.synchronize(self.device)
        self._count_stalls()
        n = max(1, self._seconds["steps"])
        return {k: round(v / n, 4) for k, v in self._seconds.items() if k != "steps"}

    def check_idle(self) -> None:
        self.finish()
        super().check_idle()

    def abandon(self) -> None:
        for c, g in list(self.grads.items()):
            if isinstance(g, tuple):                         # offloaded: give the host buffer back
                self._host_grads.put(g[0])
                del self.grads[c]
        self._ready.clear()
        super().abandon()


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

