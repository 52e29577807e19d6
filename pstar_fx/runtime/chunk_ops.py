"""chunk_ops: `ChunkRuntime`, the `rt` the lowered graph calls (`rt.fetch(3)`, `rt.adam(2)`, ...), and the
runtime's parts it builds."""
from __future__ import annotations

import torch

from ..config import Config
from ..layout import Layout
from ..planning import Plan
from .movers import CpuCopies, CudaCopies, Mover
from .rng import StepRandom
from .store import ChunkStore
from .telemetry import MemoryStats, Telemetry
from .updater import Updater

HOST_WORKER_ON_CPU = False   # the CPU runtime updates host chunks inline; tests flip this (here) to run the worker


class ChunkRuntime:
    """The `rt` the lowered graph calls: each method is one chunk node, handed to the part that owns the work.
    The graph is the same on every device."""

    def __init__(self, layout: Layout, plan: Plan, config: Config, device: torch.device, compute_dtype: torch.dtype,
                 dp=None, ready_later: bool = False, reserve=None):
        self.layout, self.plan, self.config, self.device = layout, plan, config, device
        self.telemetry = Telemetry()
        self.stats: MemoryStats = self.telemetry.stats
        cuda = device.type == "cuda"
        self.copies = CudaCopies(device, self.telemetry) if cuda else CpuCopies()
        # ready_later: the host buffers' page-locking goes on after this returns, until `store.ready()`
        self.store = ChunkStore(layout, plan, config, device, compute_dtype, self.stats, ready_later, reserve)
        self.dp = dp                             # runtime.dist.DataParallel with several ranks
        self.mover = Mover(self.store, plan, self.copies, self.telemetry, dp)
        self.updater = Updater(self.store, plan, self.copies, self.telemetry, self.mover,
                               worker=cuda or HOST_WORKER_ON_CPU, grad_accum=config.grad_accum, dp=dp)
        self._offloaded: dict[int, tuple] = {}
        self._reducing: dict[int, object] = {}   # chunk -> its gradient's reduce to the owner, in flight
        self.rng = StepRandom(device, config.seed)
        if dp is not None:
            self.rng.rank = dp.rank              # each rank's dropout draws its own masks

    # ---- what the lowered graph calls ----------------------------------------------------------------
    def prefetch(self, c: int) -> None:
        """The copy reads the master (or shadow) the host Adam writes: with that update still running, the copy
        starts on the worker as it ends, where it can (the fetch then waits for the update); else here, after it."""
        pending = self.updater.host_worker.copy_job(c)
        if pending is not None and self.mover.copies_alone(c):
            self.mover.prefetch(c, after=pending)
            return
        self.updater.wait_for(c, copy=True)
        self.mover.prefetch(c)

    def fetch(self, c: int) -> None:
        self.updater.wait_for(c, copy=True)      # its update's outcome, on this thread (a failure raises here)
        self.mover.fetch(c)

    def release(self, c: int) -> None:
        self.mover.release(c)

    def all_reduce(self, c: int) -> None:
        """Chunk c's gradient summed over the data-parallel ranks, before its update."""
        self.dp.sum_(self.mover.grads[c][: self.layout.chunks[c].used_elems])

    def reduce(self, c: int) -> None:
        """Chunk c's gradient summed over the ranks into its owner's gradient slot (chunk-partitioned data
        parallelism); started here, waited for by the chunk's update, which the graph runs one chunk later."""
        buf = self.mover.grads[c][: self.layout.chunks[c].used_elems]
        self._reducing[c] = self.dp.reduce_chunk(buf, c)
        self.stats.coll_bytes += buf.numel() * buf.element_size()

    def _reduced(self, c: int) -> None:
        self.copies.compute_waits(self._reducing.pop(c, None))

    def seed_random(self, k: int) -> None:
        """The next random op (the k-th in the graph) draws from its own seed for this step."""
        self.rng.seed_op(k)

    def param(self, index: int) -> torch.Tensor:
        return self.mover.param(index)

    def grad(self, index: int, g: torch.Tensor) -> None:
        self.mover.grad(index, g)

    def grad_mm(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Parameter `index`'s gradient is a @ b, computed straight into its chunk's gradient slot."""
        self.mover.grad_mm(index, a, b)

    def offload(self, c: int) -> None:
        """A host chunk's gradients go to the host, where its state is updated."""
        self._reduced(c)
        flag = self.updater.measure_device(c, self.mover.grads[c])
        dst = self.updater.host_slot(c)
        self._offloaded[c] = (dst, self.mover.offload(c, dst, flag), flag is not None)

    def adam(self, c: int) -> None:
        """Chunk c's gradient is complete: the updater takes it (what it does with it is the open pass's:
        step_log.StepPass). A chunk another rank owns: its gradient went there; the slot is free."""
        self._reduced(c)
        if not self.store.holds(c):
            self.mover.give_back(self.mover.hand_over(c))
        elif c in self._offloaded:
            dst, ready, checked = self._offloaded.pop(c)
            self.updater.update(c, dst, ready, checked)
        else:
            self.updater.update(c, self.mover.hand_over(c))

    # ---- for the engine ------------------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        return self.store.owns(t)

    def clear(self) -> None:
        """After a step that failed midway: every slot back to its pool, nothing in flight."""
        self.mover.clear()
        for dst, *_ in self._offloaded.values():
            if not self.updater.kept.holds(dst):
                self.updater.kept.host_grads.give(dst)
        self._offloaded.clear()
        for pending in self._reducing.values():   # nothing may still write into a slot handed out again
            pending.abandon()
        self._reducing.clear()

    def drain(self) -> None:
        self.updater.drain()

    def timing(self) -> dict[str, float]:
        """Seconds per step: the compute stream stalled on chunk copies; host Adam work (on the worker);
        the launching thread waited for a free host gradient buffer; prefetches waited for a host chunk's
        update; corrections of speculative updates (clipping that triggered); on CUDA, the compute stream's idle
        time those two waits caused (`gpu_idle_for_host_grad_buffer`, `gpu_idle_for_host_adam`: telemetry.py)."""
        self.drain()
        self.copies.sync()
        return self.telemetry.per_step()

