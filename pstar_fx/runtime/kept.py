"""kept: gradients kept until the step's verdict, accumulators, and the host buffers gradients land in.

A keeping transaction (kept_grads, deferred: `planning.transaction.KEEPS`) keeps every updated chunk's gradient until
the verdict; an accumulating step sums each chunk's micro-batch gradients into an fp32 accumulator on its tier
instead. Without kept buffers, host chunks' gradients land in a small pool of host buffers (`host_grads`).
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from ..planning import Plan
from ..planning.transaction import KEEPS, kept_here
from .movers import Mover
from .store import ChunkStore, Pool


class KeptGradients:
    def __init__(self, store: ChunkStore, plan: Plan, copies, mover: Mover, *, accumulates: bool, blocking: bool):
        self.store, self.copies, self.mover = store, copies, mover
        # a trainable chunk's gradient: as long as its state (Layout.state_elems: shorter beside frozen chunks)
        elems, dtype = store.layout.state_elems, store.compute_dtype
        updated = [c for c, s in enumerate(store.grad_spans) if s and store.holds(c)]
        host = [c for c in updated if store.tier(c) == "host"]
        self.grads: dict[int, torch.Tensor] = {}
        # (plan.kept_in_shadow: a host chunk's gradient lands in its 16-bit shadow, which the host Adam then
        # overwrites with the new weights; `shadows_from_masters` rewrites them when that did not happen)
        self.in_shadow: list[int] = []
        self.kept: set[int] = set()                     # the chunks whose gradient is kept
        self.in_activations: set[int] = set()           # of those, kept on the device from backward to the step's end
        if plan.transaction in KEEPS and not accumulates:
            # the first `plan.kept_on_device` updated device chunks keep theirs on the device: the ones the next
            # forward reads first (the planner counted them beside the device peak, or node by node in what backward
            # frees: `plan.kept_in_activations`, allocated as `keep` takes each and released by `release`)
            here = set(kept_here([c for c in updated if store.tier(c) == "device"], plan.kept_on_device))
            where = lambda c: "device" if c in here else "host"  # noqa: E731
            self.in_shadow = [c for c in updated if plan.kept_in_shadow and store.tier(c) == "host"]
            self.kept = set(updated)
            self.in_activations = here if plan.kept_in_activations else set()
            self.grads = {c: store.shadow[c] if c in self.in_shadow else store.alloc(where(c), elems, dtype)
                          for c in updated if c not in self.in_activations}
        self.acc = {c: store.alloc(store.tier(c), elems, torch.float32) for c in updated} if accumulates else {}
        staging = 0 if (self.grads or not host) else max(1, plan.host_grad_buffers)
        self.host_grads = Pool([store.alloc("host", elems, dtype) for _ in range(staging)], blocking=blocking)

    def copies_first(self, chunks: list[int], worker) -> list[int]:
        """Of host `chunks` about to get a job after the verdict, those whose 16-bit shadow that job writes first
        (`HostWorker.COPIES_FIRST`, on the threaded worker): each shadow the forward reads that holds no kept
        gradient (one that does would lose it to the new weights before the state's job read it)."""
        if not (worker.COPIES_FIRST and worker.threaded):
            return []
        return [c for c in chunks
                if c in self.store.shadow and self.store.tier(c) == "host" and c not in self.in_shadow]

    def __contains__(self, c: int) -> bool:
        """Whether chunk c's gradient is kept (in its own buffer) until the verdict."""
        return c in self.kept

    def get(self, c: int) -> torch.Tensor | None:
        """Chunk c's kept gradient buffer."""
        return self.grads.get(c)

    def holds(self, buf: torch.Tensor) -> bool:
        return any(buf is kept for kept in self.grads.values())

    def keep(self, c: int, grad: torch.Tensor) -> torch.Tensor:
        """A device chunk's gradient kept until the verdict; returns the buffer for the gradient slot pool. Kept
        on the device, the slot itself becomes the kept buffer and the one it replaces (as large, and free: its
        last reader was the last step's verdict) joins the pool: no copy (bench/RESULTS.md, session 6). Kept on
        the host, the gradient is shipped there and the slot goes back. Kept in the activations' memory, it is copied
        into a buffer allocated now, where backward has freed activations, and the slot goes back."""
        if c in self.in_activations:
            # copied, not kept in its slot: a slot kept and a new one allocated in its place moved the pool's slots
            # into the activations' memory step after step, and the allocator, finding no block in what was left,
            # emptied its cache and tried again about once a step (18 retries in 19 steps against 6 copying, the
            # untriggered step 2.4% faster: bench/RESULTS.md, session 39); the copy reads and writes it once
            self.grads[c] = torch.empty_like(grad).copy_(grad)
            return grad
        kept = self.grads[c]
        if kept.device == grad.device:
            self.grads[c] = grad
            return kept
        self.mover.ship(grad, kept, self.store.layout.chunks[c].used_elems)
        return grad

    def accumulate(self, c: int, grad: torch.Tensor, first: bool) -> None:
        acc = self.acc[c]
        for off, n in self.store.grad_spans[c]:
            if first:
                acc[off: off + n].copy_(grad[off: off + n])
            else:
                acc[off: off + n].add_(grad[off: off + n])

    def on_tier(self, c: int) -> torch.Tensor:
        """Chunk c's kept (or accumulated) gradient on the chunk's own tier (a device chunk's comes back from the
        host into a gradient slot); `done_with` returns such a slot."""
        src = self._source(c)
        if src.device == self.store.master[c].device:
            return src
        buf = self.mover.grad_slots.take()
        n = self.store.layout.chunks[c].used_elems
        buf[:n].copy_(src[:n])
        return buf

    def on_device_in_order(self, chunks: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """Yields (c, c's kept gradient on the device) for each of `chunks` (device chunks), in order; the caller
        queues c's kernel before asking for the next (inside `Mover.after_verdict`: on its stream). Those kept on
        the device come first, while the others come back from the host on the copy stream into the gradient slots,
        each copy queued as soon as a slot's last reader is: the launching thread never waits for a copy, and the
        kernels' stream waits only for the one it reads next (with one blocking copy per chunk, a correction at
        Llama-3-8B's shape spent 0.25-0.36 s on the launching thread: issue 24)."""
        here = [c for c in chunks if self._source(c).device == self.device]
        back = [c for c in chunks if self._source(c).device != self.device]
        coming: deque = deque()
        if back:
            self.copies.back_after_copies_out()    # the gradients shipped to the host in backward have landed
        start = lambda c: coming.append((c, *self.mover.bring_back(self._source(c), self._used(c))))  # noqa: E731
        ahead = iter(back)
        try:
            for c in back[:max(1, self.mover.grad_slots.free)]:
                start(next(ahead))
            for c in here:
                yield c, self._source(c)
            while coming:
                c, buf, copied = coming[0]
                self.copies.wait(copied)
                yield c, buf
                coming.popleft()
                self.mover.read_back_done(buf)
                nxt = next(ahead, None)
                if nxt is not None:
                    start(nxt)
        finally:                                        # an exception in a caller's kernel: the slots go back
            for _, buf, _ in coming:
                self.mover.read_back_done(buf)

    @property
    def device(self) -> torch.device:
        return self.store.device

    def _source(self, c: int) -> torch.Tensor:
        return self.acc[c] if c in self.acc else self.grads[c]

    def _used(self, c: int) -> int:
        return self.store.layout.chunks[c].used_elems

    def done_with(self, grad: torch.Tensor, c: int) -> None:
        if grad is not self.acc.get(c) and grad is not self.grads.get(c):
            self.mover.give_back(grad)

    def release(self) -> bool:
        """The step's end: the gradients kept in the activations' memory go back to the allocator, each once the
        work queued after the verdict that reads it has run (`copies.free_after`). Returns whether any was held."""
        held = [self.grads.pop(c) for c in self.in_activations if c in self.grads]
        for buf in held:
            self.copies.free_after(buf, "late")
        return bool(held)

    def shadows_from_masters(self) -> None:
        """The shadows that hold a kept gradient instead of weights (a step that did not apply its updates, or
        did not finish them) are cast again from their masters, once no copy writes into them."""
        if self.in_shadow:
            self.copies.sync()
            self.store.masters_changed(self.in_shadow)
