"""updater: each chunk's update for the open step — the only caller of chunk_update.

Each `rt.adam(c)` hands the updater chunk c's complete gradient (in a device gradient slot, or already on the
host for a host chunk). What it does with it is what the open pass says (`step_log.StepPass`), which the
step's transaction chose (transactions.py). Its parts: the verdict (verdict.py), kept gradients and accumulators
(kept.py), the host worker (host_worker.py) and what takes updates back (undo.py).
"""
from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from ..optim import Hyper, chunk_update
from ..planning import Plan
from .host_worker import HostWorker
from .kept import KeptGradients
from .movers import Mover
from .step_log import AFTER_VERDICT, REPLAY, StepLog, StepPass
from .store import ChunkStore
from .telemetry import Telemetry
from .undo import Undo
from .verdict import Verdict


class Updater:
    def __init__(self, store: ChunkStore, plan: Plan, copies, telemetry: Telemetry, mover: Mover, *,
                 worker: bool, grad_accum: int, dp=None):
        self.store, self.copies, self.telemetry, self.mover = store, copies, telemetry, mover
        self.device = store.device
        dp = dp if dp is not None and dp.chunked else None   # partitioned: this rank updates its own chunks
        has_host = any(s and store.holds(c) and store.tier(c) == "host" for c, s in enumerate(store.grad_spans))
        self.kept = KeptGradients(store, plan, copies, mover, accumulates=grad_accum > 1, blocking=worker)
        self.norms = Verdict(store.layout, self.device, dp)   # the verdict: norm vector, finiteness flags
        self.host_worker = HostWorker(telemetry, threaded=worker and has_host)
        self.undo = Undo(store, self.kept, self.host_worker, self.norms, copies, telemetry)
        self.step_log: StepLog | None = None      # the step running now
        self._first_micro = self._last_micro = True
        self.settling_rolled_back = False          # abandon: the step before failed in its own update too

    @property
    def worker(self):
        """The host worker's thread pool (None: host jobs run inline)."""
        return self.host_worker.executor

    @property
    def settling(self) -> StepLog | None:
        """The step before, while some of its host updates run."""
        return self.host_worker.settling

    # ---- the step's frame ----------------------------------------------------------------------------
    def open(self, hyper: Hyper, kind: StepPass) -> None:
        self.step_log = StepLog(hyper, kind, undoable=kind.undoable)
        self.undo.not_undone = []
        self.norms.reset()

    def micro(self, first: bool, last: bool) -> None:
        """Which micro-batch of an accumulating step runs next."""
        self._first_micro, self._last_micro = first, last

    def measure_device(self, c: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A host chunk's gradient, still on the device: its squared norm joins the verdict there. Returns
        (whether it is finite, on the device; its host flag) for the offload to copy down beside the gradient,
        so the host Adam skips its own non-finite pass; None when not measured here."""
        if self.step_log.kind.accumulates:
            return None
        return self.norms.measure_offload(c, buf)

    def host_slot(self, c: int) -> torch.Tensor:
        """Where chunk c's gradient lands on the host (its kept buffer, or one of the pool's)."""
        if c in self.kept:
            self.wait_for(c)                # the settling step's update of c still reads this buffer
            return self.kept.get(c)
        with self.telemetry.host_wait("wait_for_host_grad_buffer"):
            return self.kept.host_grads.take()   # blocks only while the host Adam is behind

    def update(self, c: int, grad: torch.Tensor, ready=None, checked: bool = False) -> None:
        """Chunk c's gradient is complete (its last contribution in backward has been written). `checked`: a host
        chunk's finiteness was measured on the device and lands in its host flag with the gradient."""
        self.wait_for(c)
        log = self.step_log
        if self.store.tier(c) == "host":
            # (an accumulating pass queues a chunk's job once a micro-batch: those keep their order)
            landed = None if log.kind.accumulates else (lambda: self.copies.landed(ready))
            self.host_worker.run(c, log, self._host_job, c, grad, ready, log, log.kind, self._first_micro,
                                 self._last_micro, checked, landed=landed)
            return
        kind, back = log.kind, grad                  # back: what the gradient slot pool gets back
        if kind.replays:
            self.undo.replay_moments(c, grad, log)
        elif kind.accumulates:
            self.kept.accumulate(c, grad, self._first_micro)
            if self._last_micro:
                self.norms.add(self.kept.acc[c], c)
        else:
            sq = self.norms.add(grad, c)
            if kind.updates:
                self.norms.gate(sq)
            if kind.keeps:                           # kept before it is used
                back = self.kept.keep(c, grad)
            if kind.updates:
                self._update_device(c, grad, log.hyper)
        self.mover.give_back(back)

    def pass_queued(self) -> None:
        """The pass has queued its last update: the host ones not started run in the next forward's order
        (host_worker.py)."""
        self.host_worker.close_pass()

    def _update_device(self, c: int, grad: torch.Tensor, hyper: Hyper, found_inf: torch.Tensor | None = None) -> None:
        found_inf = self.norms.found_inf if found_inf is None else found_inf
        self._adam(c, grad, hyper, found_inf=found_inf, check_finite=False)
        self.norms.launched(c, found_inf)
        self.step_log.device.append(c)

    def _host_job(self, c, grad, ready, log: StepLog, kind, first: bool, last: bool, checked: bool = False) -> bool:
        """A host chunk's part of the step (on the worker, or inline on the CPU runtime), as the pass that queued it
        (`kind`) says: by the time the worker runs it, the step may have moved on (a deferred step's verdict sets
        `log.kind` to AFTER_VERDICT, and a job of its backward read then would have updated its chunk twice)."""
        try:
            self.copies.host_waits(ready)             # the gradient (and its finite flag) have landed
            t0 = time.perf_counter()
            applied = False
            if kind.replays:
                applied = self.undo.replay_moments(c, grad, log)
            elif kind.accumulates:
                self.kept.accumulate(c, grad, first)
                if last:
                    log.host_sq.update(self.norms.host_squares(c, self.kept.acc[c]))
            elif kind.updates:                    # (measured on the device; deferred: it waits in its kept buffer)
                if checked and not self.norms.host_finite(c):
                    applied = False                   # non-finite on the device: the step will be skipped
                else:
                    # a speculative update that starts after its step's correction was decided applies the
                    # verdict's coefficient at once: no correction for it (the update the worker had not reached
                    # when clipping triggered, often most host chunks': their updates run into the next forward)
                    right = log.verdict_hyper if kind.keeps else None
                    applied = self._adam(c, grad, right or log.hyper, check_finite=not checked)
                    if right is not None and applied:
                        log.hyper_of[c] = right
            took = time.perf_counter() - t0
            self.telemetry.add("host_adam", took)
            if applied and not kind.replays:          # a whole update (host_rate.py: the host Adam's rate)
                self.telemetry.adam_done(self._elems(c), took)
            return applied
        finally:
            if c not in self.kept:
                self.kept.host_grads.give(grad)

    def _elems(self, c: int) -> int:
        """The parameters an update of chunk c runs over."""
        return sum(end - start for start, end in self.store.state(c).update_spans)

    def _adam(self, c: int, grad: torch.Tensor, hyper: Hyper, *, shadow: bool = True, **kw) -> bool:
        """Chunk c's update from `grad`, writing its shadow too unless `shadow` is False (chunk_update's keywords:
        found_inf, check_finite, copy_only)."""
        s = self.store.state(c)
        return chunk_update(s.master, grad, s.exp_avg, s.exp_avg_sq, s.update_spans, hyper, absmax=s.absmax,
                            param_out=s.shadow if shadow else None, **kw)

    # ---- the verdict and what follows it --------------------------------------------------------------
    def verdict(self) -> float:
        """The step's global sum of squared gradient entries (scaled by the loss scale squared): one sync.
        An accumulating step waits for its host chunks' sums here."""
        with record_function("pstar_fx.verdict"):
            if self.step_log.kind.only_measures:
                self.host_worker.settle(self.step_log)
            return self.norms.total(self.step_log.host_sq)

    def apply_accumulated(self, hyper: Hyper) -> None:
        """An accumulating step's updates, from the accumulators, now that the verdict allows them."""
        self._apply_after_verdict(hyper, self.kept.acc, check_host=True)

    def apply_deferred(self, hyper: Hyper) -> None:
        """A deferred step's updates, from the kept gradients, now that the verdict allows them (it found every
        gradient finite: no check)."""
        self.step_log.undoable = self.store.config.moments_undoable   # from the kept gradients; not bf16 or int8
        self.step_log.why_not_undoable = f"with {self.store.config.optimizer_state} moments (which cannot be undone)"
        self._apply_after_verdict(hyper, self.kept.grads, check_host=False)

    def skip_deferred(self) -> None:
        """A deferred step's verdict was non-finite: nothing is applied; shadows holding gradients get their
        weights back."""
        self.kept.shadows_from_masters()

    def _apply_after_verdict(self, hyper: Hyper, grads: dict[int, torch.Tensor], check_host: bool) -> None:
        """Every chunk's update from `grads` (chunk -> its gradient, kept until the verdict): host chunks on the
        worker, queued first, so the host Adam (the longer of the two) starts at the verdict and does not wait
        for the device chunks' gradients to come back from the host (bench/RESULTS.md, session 8: 0.35 s at
        GPT3_18B); then device chunks, on the stream the next forward waits for only where it reads each
        (`Mover.after_verdict`), their kept gradients coming back on the copy stream
        (`KeptGradients.on_device_in_order`)."""
        log = self.step_log
        log.hyper, log.kind = hyper, AFTER_VERDICT
        host = [c for c in sorted(grads) if self.store.tier(c) == "host"]
        # (HostWorker.COPIES_FIRST: each host chunk's new 16-bit shadow first, the forward waiting for those alone,
        # its master and moments after them; a deferred step's kept gradients only: an accumulator is refilled by
        # the next step's first micro-batch, whose job on the worker comes after anyway, but is not split here)
        split = self.kept.copies_first(host, self.host_worker) if grads is self.kept.grads else []
        with record_function("pstar_fx.apply_after_verdict"):
            self.host_worker.after_verdict(host, log, lambda c, part: self._apply_host(c, log, grads[c], check_host,
                                                                                       part), split)
            with self.mover.after_verdict() as queued:      # (the next forward waits for each where it reads it)
                for c, grad in self.kept.on_device_in_order([c for c in sorted(grads) if self.store.tier(c) != "host"]):
                    self._update_device(c, grad, hyper, found_inf=self.norms.none_found)
                    queued(c)

    def _apply_host(self, c: int, log: StepLog, grad: torch.Tensor, check: bool, part: str = "all") -> bool:
        """A host chunk's update after the verdict. `part`: "all"; "copy", its new 16-bit shadow alone; "state", the
        rest (the master and moments: the "copy" job before it wrote the shadow; if this one fails, the shadow gets
        the master's weights back, which the update, all or nothing, left as they were)."""
        t0 = time.perf_counter()
        try:
            ok = self._adam(c, grad, log.hyper, check_finite=check, shadow=part != "state", copy_only=part == "copy")
        except BaseException:
            if part == "state":
                self.store.masters_changed([c])
            raise
        took = time.perf_counter() - t0
        self.telemetry.add("host_adam", took)
        if ok and part == "all":
            self.telemetry.adam_done(self._elems(c), took)
        return ok

    def rollback(self) -> list[int]:
        """Undo every update this step applied; returns the chunks restored."""
        return self.undo.undo(self.step_log)

    def correct(self, hyper: Hyper) -> None:
        """Undo each speculative update and apply it again with `hyper`'s clip coefficient (undo.py)."""
        self.undo.correct(self.step_log, hyper)

    def restore_masters(self) -> dict[int, Hyper]:
        """The first half of a replay (undo.py)."""
        return self.undo.restore_masters(self.step_log)

    def open_replay(self, hyper: Hyper | None) -> None:
        """The second half: the step runs again; `hyper` is the corrected update (None: only restore)."""
        self.open(self.step_log.hyper if hyper is None else hyper, REPLAY)
        self.step_log.redo = hyper is not None

    def applied_chunks(self) -> list[int]:
        return self.undo.applied_chunks(self.step_log)

    def commit(self) -> None:
        """The step stands. Host updates may still be running: the step settles as they finish. The gradients kept in
        the activations' memory go back now, before the next forward needs that memory: should a host update of
        this step fail after this, the step cannot be undone (it needs them), as with a replay."""
        log = self.step_log
        if self.kept.release() and log.pending_host() and log.undoable:
            log.undoable = False
            log.why_not_undoable = ("its device chunks' kept gradients were released at the step's end (kept in the "
                                    "memory backward frees: Plan.kept_in_activations)")
        self.host_worker.committed(log)
        self.step_log = None

    def abandon(self) -> list[int]:
        """After an exception: every update of this step is undone if it can be. The step before returned, so
        its updates still running stand once they finish; only if one of them failed is that step rolled back
        too (`settling_rolled_back`: the stepper then counts it as not having happened). Returns the chunks
        restored."""
        restored = []
        self.settling_rolled_back = False
        settling, self.host_worker.settling = self.host_worker.settling, None
        if settling is not None:
            try:
                self.host_worker.settle(settling)
            except BaseException:  # noqa: BLE001 - its own failure: the exception raised is the step's
                restored += self.undo.undo(settling, swallow=True)
                self.settling_rolled_back = settling.undoable
        if self.step_log is not None:
            restored += self.undo.undo(self.step_log, swallow=True)
            self.step_log = None
        self.kept.release()
        self.kept.shadows_from_masters()
        return restored

    # ---- host updates in flight ---------------------------------------------------------------------
    def wait_for(self, c: int, copy: bool = False) -> None:
        """Chunk c's master (and shadow) must be current: wait for its pending host update (a settling step's
        failure rolls that step back here: undo.py). `copy`: only its compute copy is about to be read: wait for
        what makes that current (a job after the verdict may write the 16-bit copy before the master:
        host_worker.py)."""
        try:
            (self.host_worker.wait_for_copy if copy else self.host_worker.wait_for)(c, self.step_log)
        except BaseException as e:
            self.undo.settling_failed(e)

    def drain(self) -> None:
        """Wait for every host update still running (state_dict, the end of training); the current stream waits for
        the device chunks' work after the last verdict."""
        for c in list(self.host_worker.pending):
            self.wait_for(c)
        self.mover.join_late()
