"""undo: what takes a step's updates back — rollback, correction, a replay's restores — the only caller of
chunk_undo (optim/adam.py says how exact an undo is).

A rollback or a correction needs the gradient each update consumed: the kept gradients or the accumulators
(kept.py). A replay keeps none: the masters are restored from the updated moments first (`restore_masters`),
then the step runs again and each chunk's recomputed gradient restores its moments (`replay_moments`).
If a settling step's host job fails (host_worker.py), that step is rolled back from the gradients it kept (still
intact: the next step overwrites them only in its backward, after its forward waited for every one of those
updates) and the error is raised as `StepRolledBack`; a step that kept nothing cannot be, and the error says so.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import torch
from torch.profiler import record_function

from ..optim import Hyper, chunk_rescale, chunk_undo
from .host_worker import HostWorker
from .kept import KeptGradients
from .step_log import StepLog, StepRolledBack
from .store import ChunkStore
from .telemetry import Telemetry
from .verdict import Verdict


class Undo:
    def __init__(self, store: ChunkStore, kept: KeptGradients, worker: HostWorker, norms: Verdict, copies,
                 telemetry: Telemetry):
        self.store, self.kept, self.worker, self.norms = store, kept, worker, norms
        self.copies, self.telemetry = copies, telemetry
        self.replaying: dict[int, Hyper] = {}      # a replay: chunk -> the Hyper of the update it undoes
        self.not_undone: list[int] = []            # chunks a failed step updated and nothing could undo

    def _chunk_undo(self, c: int, grad: torch.Tensor | None, hyper: Hyper, *, redo: Hyper | None = None,
                    part: str = "all", shadow: bool = True) -> None:
        s = self.store.state(c)
        chunk_undo(s.master, grad, s.exp_avg, s.exp_avg_sq, s.grad_spans, hyper, redo=redo, part=part,
                   param_out=s.shadow if shadow else None)

    def applied_chunks(self, log: StepLog) -> list[int]:
        """The chunks whose update `log`'s step applied (its host updates must have finished)."""
        self.worker.settle(log)
        self.copies.sync()
        return self.norms.applied(log.device) + [c for c, ok in log.host.items() if ok is True]

    def undo(self, log: StepLog, swallow: bool = False) -> list[int]:
        """Restore the chunks `log`'s step updated; returns them. With `swallow`, failed host updates count as
        what they left."""
        self.worker.settle(log, swallow)
        if log.kind.only_measures:
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
            grad = self.kept.on_tier(c)
            self._chunk_undo(c, grad, hyper)
            log.hyper_of[c] = None
            self.kept.done_with(grad, c)
        self.copies.sync()
        return applied

    def correct(self, log: StepLog, hyper: Hyper) -> None:
        """The speculative updates used a guessed clip coefficient: undo each and apply it with `hyper`'s. The
        verdict found every gradient finite, so every update launched was applied. Host chunks first, each queued on
        the worker behind its own update, in the order the next forward reads them (chunk order: the layout fills
        chunks in the order the forward first uses their parameters), so the forward's first host chunk is corrected
        first and the host work starts at the verdict; their corrections overlap the next forward as their updates
        do (a read waits for its chunk). Then the device chunks, on a stream of their own that the next forward
        waits for only where it reads each (`Mover.after_verdict`), their kept gradients coming back from the host
        on the copy stream (`KeptGradients.on_device_in_order`). A host update the worker
        had not started when this was decided applies `hyper` itself (`StepLog.verdict_hyper`); its correction is
        then nothing."""
        t0 = time.perf_counter()
        speculated = log.hyper
        log.verdict_hyper = hyper                          # host updates not yet started apply it directly
        updates = dict(log.host)                           # each host chunk's update: its future, or its outcome
        # (HostWorker.COPIES_FIRST: a chunk the forward reads as its 16-bit shadow gets that copy corrected first,
        # the forward waiting for those alone, the masters and moments after them while the forward runs)
        chunks = sorted(updates)
        with record_function("pstar_fx.correct"):
            self.worker.after_verdict(chunks, log, lambda c, part: self._correct_host(log, c, updates, speculated,
                                                                                      hyper, part),
                                      self.kept.copies_first(chunks, self.worker))
            with self.kept.mover.after_verdict() as queued:
                for c, grad in self.kept.on_device_in_order(sorted(log.device)):
                    self._correct_one(log, c, grad, speculated, hyper)
                    queued(c)
        self.telemetry.add("correction", time.perf_counter() - t0)

    def _correct_host(self, log: StepLog, c: int, updates: dict, speculated: Hyper, hyper: Hyper,
                      part: str = "all") -> bool:
        """A host chunk's correction, on the worker after every host update of the step (one thread, in order:
        `updates` are done). Its own update failed: its error is raised here (it changed nothing). Another's failed:
        the step will be rolled back, so this chunk is left as its update left it, and the rollback undoes that one
        update (undoing a correction too would add its rounding). `part`: "all"; "copy", the corrected 16-bit
        shadow alone; "state", the rest (the shadow was written by the "copy" job queued before it)."""
        outcome = {k: u.exception() if isinstance(u, Future) else None for k, u in updates.items()}
        if outcome[c] is not None:
            raise outcome[c]
        if not (updates[c].result() if isinstance(updates[c], Future) else updates[c]):
            return False                                   # not applied: nothing to correct
        if any(e is not None for e in outcome.values()):
            return True
        if log.hyper_of.get(c) is hyper:
            return True                                    # its update started after the verdict: already right
        t0 = time.perf_counter()
        if part == "copy":                                 # the state stays as the update left it
            self._rescale(c, self.kept.on_tier(c), speculated, hyper, copy_only=True)
        else:
            self._correct_one(log, c, self.kept.on_tier(c), speculated, hyper, shadow=part == "all")
        self.telemetry.add("host_adam", time.perf_counter() - t0)
        return True

    def _correct_one(self, log: StepLog, c: int, grad: torch.Tensor, speculated: Hyper, hyper: Hyper,
                     shadow: bool = True) -> None:
        """One pass from the speculated state to the verdict's (chunk_rescale: fp32, no undo): on the host worker
        the pass runs at memory speed, where the undo-then-redo's float64 arithmetic bound it (issue 24)."""
        log.hyper_of[c] = speculated                       # applied with the guess, until the pass below
        self._rescale(c, grad, speculated, hyper, shadow=shadow)
        log.hyper_of[c] = hyper

    def _rescale(self, c: int, grad: torch.Tensor, speculated: Hyper, hyper: Hyper, *, shadow: bool = True,
                 copy_only: bool = False) -> None:
        s = self.store.state(c)
        chunk_rescale(s.master, grad, s.exp_avg, s.exp_avg_sq, s.grad_spans, speculated, hyper,
                      param_out=s.shadow if shadow else None, copy_only=copy_only)

    def restore_masters(self, log: StepLog) -> dict[int, Hyper]:
        """The first half of a replay: every chunk the (speculative, nothing kept) step updated gets its master
        back from its updated moments; host chunks on the worker, so the replay's forward waits for each
        chunk alone. Returns chunk -> the Hyper its update used (what the replay's moment undo inverts)."""
        applied = {c: log.hyper_of.get(c, log.hyper) for c in self.applied_chunks(log)}
        for c, hyper in applied.items():
            if self.store.tier(c) == "host":
                self.worker.run(c, None, self._restore_master, c, hyper)
            else:
                self._restore_master(c, hyper)
        self.replaying = applied
        return applied

    def _restore_master(self, c: int, hyper: Hyper) -> bool:
        self._chunk_undo(c, None, hyper, part="param", shadow=False)
        self.store.masters_changed([c])
        return True

    def replay_moments(self, c: int, grad: torch.Tensor, log: StepLog) -> bool:
        """The second half: a replayed step's chunk c, whose recomputed gradient restores the moments and, when
        correcting, applies the right update. Returns whether an update is applied."""
        if c not in self.replaying:
            return False
        self._chunk_undo(c, grad, self.replaying[c], redo=log.hyper if log.redo else None, part="moments")
        return log.redo

    def settling_failed(self, e: BaseException):
        """A job failed where its outcome was waited for. The running step's own: re-raised (its abandon undoes
        it). The settling step's: that step is rolled back, and the error raised as StepRolledBack."""
        if not self.worker.failed_settling(e):
            raise e
        settling, self.worker.settling = self.worker.settling, None
        self.undo(settling, swallow=True)
        self.kept.shadows_from_masters()
        if not settling.undoable:
            self.not_undone = []        # (the error says so; the failed step's own abandon warns of its own)
            raise RuntimeError(f"the host Adam of an earlier step failed after that step returned ({type(e).__name__}: "
                               f"{e}); {settling.why_not_undoable}, that step cannot be undone: its other chunks stay "
                               "updated, the failed one does not") from e
        raise StepRolledBack(f"the host Adam of an earlier step failed after that step returned "
                             f"({type(e).__name__}: {e}); that step was rolled back") from e
