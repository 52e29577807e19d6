"""updater: the only caller of the chunk update and its undo — it owns the step's verdict and the host worker.

Each `rt.adam(c)` hands the updater chunk c's gradient (in a device gradient slot, or already on the host
for a host chunk). What it does with it depends on the step's mode, set by the step context:

  speculate   update now with a guessed clip coefficient (the last step's) and, with kept gradients, keep the
              gradient (a copy on the GPU or the host, or the host buffer it landed in) until the step's
              verdict: the step may still be corrected or rolled back;
  apply       update now, keep nothing (the verdict is already known, or nothing can undo it);
  measure     only add the gradient's squared norm to the verdict (the first pass of a two-pass step);
  accumulate  add the gradient into the chunk's fp32 accumulator (a micro-batch of an accumulating step);
              the last micro-batch measures the accumulated gradient; the update is applied after the verdict;
  defer       only keep the gradient (in the chunk's kept buffer) and measure it; every update is applied
              after the verdict from the kept gradients (`apply_deferred`);
  replay      the step runs again after a speculation that kept no gradient had to be corrected or rolled
              back: the masters were restored from the moments first (`restore_masters`); each chunk's
              recomputed gradient now restores its moments and, when correcting, applies the right update.

The verdict is the global squared norm of the step's gradient, measured on the device as gradients are
produced (device and host chunks alike, before a host chunk's gradient leaves the device), so it costs one
read of each gradient and one sync per step — never one per chunk, and never a wait for the host worker.
With chunk-partitioned data parallelism each rank measures the chunks it owns (their gradients summed there
by `rt.reduce`) and the per-parameter vector is summed over the ranks, one all-reduce per step.
It is kept per parameter, not per chunk: each parameter's squared norm is a function of its own gradient
elements only (`kernels.sq_norms`: not of its offset, its neighbours or its chunk's tier), written into a
float64 vector indexed like `Capture.params`, and the verdict adds that vector up exactly (`math.fsum`).
So the norm, the clip coefficient and the weights have the same bits at any chunk size or placement, and a
checkpoint resumed elsewhere goes on bit for bit (CPU). On CUDA the same holds except for an accumulating
step: there a host chunk's accumulated gradient is measured on the host (C++), a device chunk's on the
device (Triton), and the two round differently in the last bits.
A non-finite norm skips the step. Updates are applied only with finite gradients (the device flag
`found_inf` gates the Triton Adam; a host chunk's finiteness, measured on the device with its norm, crosses to the
host in the same copy as its gradient and gates the C++ Adam, which so needs no non-finite pass of its own: 2 of the
30 bytes per parameter it would move; an accumulated gradient, measured on the host, is checked there), so a
rollback never meets a NaN.

Host chunks are updated by the C++ Adam on one worker thread while the GPU goes on. A step's host updates
may still run after the step returned, into the next step's forward (chunk c's copy to the device starts on
the worker as c's update ends, and the fetch of c waits for it, `wait_for`): that step is "settling". If one
of its updates fails, the settling step is rolled back from the gradients it kept (still intact: the next
step overwrites them only in its backward, after its forward waited for every one of these updates) and the
error is raised as `StepRolledBack`; a step that kept nothing (replay) cannot be, and the error says so. An
exception in the next step for another reason leaves the settling step standing once its updates finish.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..kernels import cpu_adam, sq_norms
from ..optim import Hyper, chunk_undo, chunk_update
from ..planning import Plan
from .movers import Mover
from .store import ChunkStore, Pool
from .telemetry import Telemetry

MODES = ("speculate", "apply", "measure", "accumulate", "replay", "defer")


def exact_sum(squares: list[float]) -> float:
    """The correctly rounded sum of nonnegative float64 terms: one value whatever their order (inf on overflow,
    nan with a nan among them)."""
    try:
        return math.fsum(squares)
    except OverflowError:
        return math.inf


class StepRolledBack(RuntimeError):
    """An update of an earlier step failed after that step returned; that step was rolled back."""


@dataclass
class _Log:
    """What one step did, as far as undoing it needs to know."""
    hyper: Hyper
    mode: str
    device: list[int] = field(default_factory=list)        # device chunks whose update was launched
    host: dict[int, Future | bool] = field(default_factory=dict)   # host chunk -> applied (or its future)
    host_sq: dict[int, float] = field(default_factory=dict)   # parameter -> its squared norm, measured on the host
    undoable: bool = False
    redo: bool = False                                     # a replay that applies the corrected update
    hyper_of: dict[int, Hyper | None] = field(default_factory=dict)   # a chunk corrected (or undone) since: its Hyper

    def pending_host(self) -> bool:
        return any(isinstance(f, Future) for f in self.host.values())


class Updater:
    def __init__(self, store: ChunkStore, plan: Plan, copies, telemetry: Telemetry, mover: Mover, *,
                 worker: bool, grad_accum: int, dp=None):
        self.store, self.plan, self.copies, self.telemetry, self.mover = store, plan, copies, telemetry, mover
        self.dp = dp if dp is not None and dp.chunked else None   # partitioned: this rank updates its own chunks
        layout, cs, dtype = store.layout, store.layout.chunk_size, store.compute_dtype
        self.layout, self.device = layout, store.device
        self.spans = [ch.grad_spans() for ch in layout.chunks]
        # what each update runs over: the same, but one span per parameter with int8 moments (quantized apart)
        self._adam_spans = [ch.param_spans() for ch in layout.chunks] if store.quantized else self.spans
        # per chunk, the parameters it updates: where their gradients lie, and their index in Capture.params
        graded = [[s for s in ch.slots if s.param.has_grad] for ch in layout.chunks]
        self._segments = [[(s.offset, s.numel) for s in g] for g in graded]
        self._params = [[s.index for s in g] for g in graded]
        self._param_index = [torch.tensor(ix, dtype=torch.long, device=self.device) for ix in self._params]
        updated = [c for c, s in enumerate(self.spans) if s and store.holds(c)]
        host = [c for c in updated if store.tier(c) == "host"]
        self.accumulates = grad_accum > 1
        # kept gradients: every chunk's, on the host, until the step's verdict (an accumulating step keeps
        # its accumulators instead)
        self.kept: dict[int, torch.Tensor] = {}
        # (plan.kept_in_shadow: a host chunk's gradient lands in its 16-bit shadow, which the host Adam then
        # overwrites with the new weights; `_shadows_from_masters` rewrites them when that did not happen)
        self._kept_in_shadow: list[int] = []
        if plan.transaction in ("kept_grads", "deferred") and not self.accumulates:
            where = lambda c: "device" if plan.kept_on_device and store.tier(c) == "device" else "host"  # noqa: E731
            self._kept_in_shadow = [c for c in updated if plan.kept_in_shadow and store.tier(c) == "host"]
            self.kept = {c: store.shadow[c] if c in self._kept_in_shadow else store.alloc(where(c), cs, dtype)
                         for c in updated}
        self.acc = {c: store.alloc(store.tier(c), cs, torch.float32) for c in updated} if self.accumulates else {}
        staging = 0 if (self.kept or not host) else max(1, plan.host_grad_buffers)
        self.host_grads = Pool([store.alloc("host", cs, dtype) for _ in range(staging)], blocking=worker)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        # per chunk, whether its gradient measured finite on the device, and its copy on the host that lands with
        # a host chunk's gradient (persistent: the copy stream reads it after the compute stream moved on)
        self._finite_dev = torch.zeros(len(layout.chunks), dtype=torch.float32, device=self.device)
        self._finite_host = torch.zeros(len(layout.chunks), dtype=torch.float32,
                                        pin_memory=self.device.type == "cuda")
        self._sq = torch.zeros(len(layout.slots), dtype=torch.float64, device=self.device)   # per parameter
        self._flag_after = torch.zeros(len(layout.chunks), dtype=torch.float32, device=self.device)
        # the worker's host Adam leaves a core to the thread that launches GPU work (cpu_adam.worker_threads)
        self.worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="pstar_fx-adam",
                                          initializer=cpu_adam.set_threads, initargs=(cpu_adam.worker_threads(),))
                       if worker and host else None)
        self.pending: dict[int, Future] = {}       # host chunk -> its update still on the worker
        self.log: _Log | None = None               # the step running now
        self.settling: _Log | None = None          # the step before, while some of its host updates run
        self._first_micro = self._last_micro = True
        self._replaying: dict[int, Hyper] = {}     # a replay: chunk -> the Hyper of the update it undoes
        self.not_undone: list[int] = []            # chunks a failed step updated and nothing could undo
        self.settling_rolled_back = False          # abandon: the step before failed in its own update too

    # ---- the step's frame ----------------------------------------------------------------------------
    def open(self, hyper: Hyper, mode: str) -> None:
        assert mode in MODES, mode
        self.log = _Log(hyper, mode, undoable=mode == "accumulate" or (mode == "speculate" and bool(self.kept)))
        self.not_undone = []
        self.found_inf.zero_()
        self._sq.zero_()

    def micro(self, first: bool, last: bool) -> None:
        """Which micro-batch of an accumulating step runs next."""
        self._first_micro, self._last_micro = first, last

    def measure_device(self, c: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A host chunk's gradient, still on the device: its squared norm joins the verdict there. Returns
        (whether it is finite, on the device; its host flag) for the offload to copy down beside the gradient,
        so the host Adam skips its own non-finite pass (2 B/param of its 30); None when not measured here."""
        if self.log.mode == "accumulate":
            return None
        sq = self._add_sq(buf, c)
        self._finite_dev[c:c + 1].copy_(torch.isfinite(sq).reshape(1))
        return self._finite_dev[c:c + 1], self._finite_host[c:c + 1]

    def host_slot(self, c: int) -> torch.Tensor:
        """Where chunk c's gradient lands on the host (its kept buffer, or one of the pool's)."""
        if c in self.kept:
            self.wait_for(c)                # the settling step's update of c still reads this buffer
            return self.kept[c]
        t0 = time.perf_counter()
        buf = self.host_grads.take()        # blocks only while the host Adam is behind
        self.telemetry.add("wait_for_host_grad_buffer", time.perf_counter() - t0)
        return buf

    def update(self, c: int, grad: torch.Tensor, ready=None, checked: bool = False) -> None:
        """Chunk c's gradient is complete (its last contribution in backward has been written). `checked`: a host
        chunk's finiteness was measured on the device and lands in its host flag with the gradient."""
        self.wait_for(c)
        if self.store.tier(c) == "host":
            self._on_host(c, self.log, self._host_job, c, grad, ready, self.log, self._first_micro, self._last_micro,
                          checked)
            return
        log = self.log
        back = grad                                  # what the gradient slot pool gets back
        if log.mode == "replay":
            self._replay_moments(c, grad, log)
        elif log.mode == "accumulate":
            self._accumulate(c, grad)
            if self._last_micro:
                self._add_sq(self.acc[c], c)
        elif log.mode == "measure":
            self._add_sq(grad, c)
        elif log.mode == "defer":
            self._add_sq(grad, c)
            back = self._keep(c, grad)
        else:
            sq = self._add_sq(grad, c)
            self.found_inf.add_((~torch.isfinite(sq)).float())   # gates this update and every later one
            if log.mode == "speculate" and self.kept:          # kept before it is used
                back = self._keep(c, grad)
            self._adam(c, grad, log.hyper, found_inf=self.found_inf, check_finite=False,
                       param_out=self.store.shadow.get(c))
            self._flag_after[c:c + 1].copy_(self.found_inf)
            log.device.append(c)
        self.mover.give_back(back)

    def _keep(self, c: int, grad: torch.Tensor) -> torch.Tensor:
        """A device chunk's gradient kept until the verdict; returns the buffer for the gradient slot pool. Kept
        on the device, the slot itself becomes the kept buffer and the one it replaces (as large, and free: its
        last reader was the last step's verdict) joins the pool: no copy (at 4.2B that was 8.4 GB a step). Kept
        on the host, the gradient is shipped there and the slot goes back."""
        kept = self.kept[c]
        if kept.device == grad.device:
            self.kept[c] = grad
            return kept
        self.mover.ship(grad, kept, self.layout.chunks[c].used_elems)
        return grad

    def _host_job(self, c, grad, ready, log: _Log, first: bool, last: bool, checked: bool = False) -> bool:
        """A host chunk's part of the step (on the worker, or inline on the CPU runtime)."""
        try:
            self.copies.host_waits(ready)             # the gradient (and its finite flag) have landed
            t0 = time.perf_counter()
            applied = False
            if log.mode == "replay":
                applied = self._replay_moments(c, grad, log)
            elif log.mode == "accumulate":
                self._accumulate(c, grad, first)
                if last:
                    log.host_sq.update(zip(self._params[c], sq_norms(self.acc[c], self._segments[c]).tolist()))
            elif log.mode not in ("measure", "defer"):        # deferred: the gradient waits in its kept buffer
                if checked and not self._finite_host[c]:
                    applied = False                   # non-finite on the device: the step will be skipped
                else:
                    applied = self._adam(c, grad, log.hyper, param_out=self.store.shadow.get(c),
                                         check_finite=not checked)
            self.telemetry.add("host_adam", time.perf_counter() - t0)
            return applied
        finally:
            if c not in self.kept:
                self.host_grads.give(grad)

    def _adam(self, c: int, grad: torch.Tensor, hyper: Hyper, **kw) -> bool:
        """Chunk c's update from `grad` (chunk_update's keywords: found_inf, param_out, check_finite)."""
        return chunk_update(self.store.master[c], grad, self.store.exp_avg[c], self.store.exp_avg_sq[c],
                            self._adam_spans[c], hyper, absmax=self.store.absmax(c), **kw)

    def _on_host(self, c: int, log: _Log | None, fn, *args) -> None:
        """Run a host chunk's job inline (the CPU runtime) or on the worker, where a read of chunk c waits for
        it; `log` records its outcome (True: an update applied)."""
        result = fn(*args) if self.worker is None else self.worker.submit(fn, *args)
        if self.worker is not None:
            self.pending[c] = result
        if log is not None:
            log.host[c] = result

    def _replay_moments(self, c: int, grad: torch.Tensor, log: _Log) -> bool:
        """A replayed step's chunk c: its recomputed gradient restores the moments (the master was restored
        first) and, when correcting, applies the right update. Returns whether an update is applied."""
        if c not in self._replaying:
            return False
        chunk_undo(self.store.master[c], grad, self.store.exp_avg[c], self.store.exp_avg_sq[c], self.spans[c],
                   self._replaying[c], redo=log.hyper if log.redo else None, part="moments",
                   param_out=self.store.shadow.get(c))
        return log.redo

    def _accumulate(self, c: int, grad: torch.Tensor, first: bool | None = None) -> None:
        acc = self.acc[c]
        first = self._first_micro if first is None else first
        for off, n in self.spans[c]:
            if first:
                acc[off: off + n].copy_(grad[off: off + n])
            else:
                acc[off: off + n].add_(grad[off: off + n])

    def _add_sq(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c's parameters' squared norms (of `t`, chunk-shaped) into the verdict's vector; returns their
        sum, for the finiteness gate only (its rounding depends on the chunk's make-up; the verdict's does not)."""
        sq = sq_norms(t, self._segments[c])
        self._sq.index_copy_(0, self._param_index[c], sq)
        return sq.sum()

    # ---- the verdict and what follows it --------------------------------------------------------------
    def verdict(self) -> float:
        """The step's global sum of squared gradient entries (scaled by the loss scale squared): one sync.
        An accumulating step waits for its host chunks' sums here."""
        if self.log.mode in ("accumulate", "measure"):
            self._settle(self.log)
        per_param = self._sq.tolist()                      # the step's one sync
        for i, sq in self.log.host_sq.items():
            per_param[i] = sq
        if self.dp is not None:
            # partitioned: each parameter's square is measured by its chunk's owner alone (zero elsewhere), so
            # the sum over ranks adds it to zeros: exact, and the same vector on every rank
            per_param = self.dp.sum_(torch.tensor(per_param, dtype=torch.float64)).tolist()
        return exact_sum(per_param)

    def apply_accumulated(self, hyper: Hyper) -> None:
        """An accumulating step's updates, from the accumulators, now that the verdict allows them."""
        self._apply_after_verdict(hyper, "apply_accumulated", self.acc, check_host=True)

    def skip_deferred(self) -> None:
        """A deferred step's verdict was non-finite: nothing is applied; shadows holding gradients get their
        weights back."""
        self._shadows_from_masters()

    def _shadows_from_masters(self) -> None:
        """The shadows that hold a kept gradient instead of weights (a step that did not apply its updates, or
        did not finish them) are cast again from their masters, once no copy writes into them."""
        if self._kept_in_shadow:
            self.copies.sync()
            self.store.masters_changed(self._kept_in_shadow)

    def apply_deferred(self, hyper: Hyper) -> None:
        """A deferred step's updates, from the kept gradients, now that the verdict allows them (it found every
        gradient finite: no check)."""
        self.log.undoable = self.store.config.moments_undoable   # from the kept gradients; not bf16 or int8
        self._apply_after_verdict(hyper, "apply_deferred", self.kept, check_host=False)

    def _apply_after_verdict(self, hyper: Hyper, mode: str, grads: dict[int, torch.Tensor], check_host: bool) -> None:
        """Every chunk's update from `grads` (chunk -> its gradient, kept until the verdict): host chunks on the
        worker, queued first, so the host Adam (the longer of the two) starts at the verdict and does not wait
        for the device chunks' gradients to come back from the host (at GPT3_18B 35 chunks, 0.35 s of copies
        that blocked this thread); then device chunks, here."""
        self.log.hyper, self.log.mode = hyper, mode
        if any(self.store.tier(c) == "device" and g.device != self.device for c, g in grads.items()):
            self.copies.sync()                       # device chunks' gradients shipped to the host have landed
        for c in sorted(grads):
            if self.store.tier(c) == "host":
                self._on_host(c, self.log, self._apply_host, c, self.log, grads[c], check_host)
        for c in sorted(grads):
            if self.store.tier(c) != "host":
                grad = self._kept_on_tier(c)
                self._adam(c, grad, hyper, found_inf=self.found_inf, check_finite=False,
                           param_out=self.store.shadow.get(c))
                self._flag_after[c:c + 1].copy_(self.found_inf)
                self.log.device.append(c)
                self._done_with(grad, c)

    def _apply_host(self, c: int, log: _Log, grad: torch.Tensor, check: bool) -> bool:
        t0 = time.perf_counter()
        ok = self._adam(c, grad, log.hyper, param_out=self.store.shadow.get(c), check_finite=check)
        self.telemetry.add("host_adam", time.perf_counter() - t0)
        return ok

    def rollback(self) -> list[int]:
        """Undo every update this step applied; returns the chunks restored."""
        return self._undo(self.log)

    def correct(self, hyper: Hyper) -> None:
        """The speculative updates used a guessed clip coefficient: undo each and apply it with `hyper`'s.
        Device chunks are corrected now, on the compute stream; host chunks on the worker, so their
        corrections overlap the next step's forward like their updates do (a read waits for its chunk)."""
        t0 = time.perf_counter()
        log, speculated = self.log, self.log.hyper
        for c in self.applied_chunks(log):
            if self.store.tier(c) == "host":
                self._on_host(c, log, self._correct_one, log, c, speculated, hyper)
            else:
                self._correct_one(log, c, speculated, hyper)
        self.telemetry.add("correction", time.perf_counter() - t0)

    def _correct_one(self, log: _Log, c: int, speculated: Hyper, hyper: Hyper) -> bool:
        t0 = time.perf_counter()
        log.hyper_of[c] = speculated                       # applied with the guess, until the undo below
        grad = self._kept_on_tier(c)
        master, m, v = self.store.master[c], self.store.exp_avg[c], self.store.exp_avg_sq[c]
        chunk_undo(master, grad, m, v, self.spans[c], speculated, redo=hyper, param_out=self.store.shadow.get(c))
        log.hyper_of[c] = hyper
        self._done_with(grad, c)
        if self.store.tier(c) == "host":
            self.telemetry.add("host_adam", time.perf_counter() - t0)
        return True

    def restore_masters(self, log: _Log | None = None) -> dict[int, Hyper]:
        """The first half of a replay: every chunk the (speculative, nothing kept) step updated gets its master
        back from its updated moments; host chunks on the worker, so the replay's forward waits for each
        chunk alone. Returns chunk -> the Hyper its update used (what the replay's moment undo inverts)."""
        log = self.log if log is None else log
        applied = {c: log.hyper_of.get(c, log.hyper) for c in self.applied_chunks(log)}
        for c, hyper in applied.items():
            if self.store.tier(c) == "host":
                self._on_host(c, None, self._restore_master, c, hyper)
            else:
                self._restore_master(c, hyper)
        self._replaying = applied
        return applied

    def _restore_master(self, c: int, hyper: Hyper) -> bool:
        master = self.store.master[c]
        chunk_undo(master, None, self.store.exp_avg[c], self.store.exp_avg_sq[c], self.spans[c], hyper, part="param")
        self.store.masters_changed([c])
        return True

    def open_replay(self, hyper: Hyper | None) -> None:
        """The second half: the step runs again; `hyper` is the corrected update (None: only restore)."""
        self.open(self.log.hyper if hyper is None else hyper, "replay")
        self.log.redo = hyper is not None
        self.log.undoable = False

    def commit(self) -> None:
        """The step stands. Host updates may still be running: the step settles as they finish."""
        if self.settling is not None:           # every chunk's update waited for it: nothing is left to run
            self._settle(self.settling)
            self.settling = None
        if self.log.pending_host():
            self.settling = self.log             # its host updates finish in the background
        self.log = None

    def abandon(self) -> list[int]:
        """After an exception: every update of this step is undone if it can be. The step before returned, so
        its updates still running stand once they finish; only if one of them failed is that step rolled back
        too (`settling_rolled_back`: the stepper then counts it as not having happened). Returns the chunks
        restored."""
        restored = []
        self.settling_rolled_back = False
        if self.settling is not None:
            settling, self.settling = self.settling, None
            try:
                self._settle(settling)
            except BaseException:  # noqa: BLE001 - its own failure: the exception raised is the step's
                restored += self._undo(settling, swallow=True)
                self.settling_rolled_back = settling.undoable
        if self.log is not None:
            restored += self._undo(self.log, swallow=True)
            self.log = None
        self._shadows_from_masters()
        return restored

    # ---- host updates in flight ---------------------------------------------------------------------
    def wait_for(self, c: int) -> None:
        """Chunk c's master (and shadow) must be current: wait for its pending host update."""
        fut = self.pending.pop(c, None)
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            applied = fut.result()
        except BaseException as e:
            self.telemetry.add("wait_for_host_adam", time.perf_counter() - t0)
            self._fail(e)
        self.telemetry.add("wait_for_host_adam", time.perf_counter() - t0)
        for log in (self.settling, self.log):
            if log is not None and log.host.get(c) is fut:
                log.host[c] = applied
        if self.settling is not None and not self.settling.pending_host():
            self.settling = None

    def drain(self) -> None:
        """Wait for every host update still running (state_dict, the end of training)."""
        for c in list(self.pending):
            self.wait_for(c)

    def _fail(self, e: BaseException):
        settling = self.settling
        if settling is None or not any(f is not None and f.done() and f.exception() is e
                                       for f in settling.host.values() if isinstance(f, Future)):
            raise e                                  # the running step's own update: its abandon undoes it
        self.settling = None
        self._undo(settling, swallow=True)
        self._shadows_from_masters()
        if not settling.undoable:
            raise RuntimeError(f"the host Adam of an earlier step failed after that step returned ({type(e).__name__}: "
                               f"{e}); with nothing kept ('replay') that step cannot be undone: its other chunks stay "
                               "updated, the failed one does not") from e
        raise StepRolledBack(f"the host Adam of an earlier step failed after that step returned "
                             f"({type(e).__name__}: {e}); that step was rolled back") from e

    def _settle(self, log: _Log, swallow: bool = False) -> None:
        """Wait for every host update of `log`'s step. With `swallow`, a failed one is recorded as the state it
        left: a failed update changed nothing (the kernels are all-or-nothing), a failed correction left its
        chunk as its `hyper_of` entry says."""
        for c, f in list(log.host.items()):
            if isinstance(f, Future):
                if self.pending.get(c) is f:
                    del self.pending[c]
                try:
                    log.host[c] = f.result()
                except BaseException:
                    if not swallow:
                        raise
                    log.host[c] = log.hyper_of.get(c) is not None

    # ---- undo ----------------------------------------------------------------------------------------
    def _undo(self, log: _Log, swallow: bool = False) -> list[int]:
        """Restore the chunks `log`'s step updated. With `swallow`, failed host updates count as what they left."""
        self._settle(log, swallow)
        if log.mode in ("measure", "accumulate"):
            return []
        applied = self.applied_chunks(log)
        if not log.undoable:
            self.not_undone = applied    # transaction "none" or a two-pass step's second pass: nothing kept
            return []
        for c in applied:
            hyper = log.hyper_of.get(c, log.hyper)
            if hyper is None:                              # a correction failed between its undo and redo
                self.store.masters_changed([c])
                continue
            grad = self._kept_on_tier(c)
            chunk_undo(self.store.master[c], grad, self.store.exp_avg[c], self.store.exp_avg_sq[c], self.spans[c],
                       hyper, param_out=self.store.shadow.get(c))
            log.hyper_of[c] = None
            self._done_with(grad, c)
        self.copies.sync()
        return applied

    def applied_chunks(self, log: _Log) -> list[int]:
        """The chunks whose update `log`'s step applied (its host updates must have finished)."""
        self._settle(log)
        self.copies.sync()
        flags = self._flag_after.tolist() if log.device else []
        return [c for c in log.device if flags[c] == 0] + [c for c, ok in log.host.items() if ok is True]

    def _kept_on_tier(self, c: int) -> torch.Tensor:
        """Chunk c's kept gradient on the chunk's own tier (a device chunk's comes back from the host)."""
        src = self.acc[c] if c in self.acc else self.kept[c]
        if src.device == self.store.master[c].device:
            return src
        buf = self.mover.grad_slots.take()
        n = self.layout.chunks[c].used_elems
        buf[:n].copy_(src[:n])
        return buf

    def _done_with(self, grad: torch.Tensor, c: int) -> None:
        if grad is not self.acc.get(c) and grad is not self.kept.get(c):
            self.mover.give_back(grad)

