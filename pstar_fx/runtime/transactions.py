"""transactions: one class per way a step is made a transaction — how it runs its passes, what it keeps, how it
commits and how it rolls back. The planner chose one (`plan.transaction`); `for_plan` builds its object once.

Every transaction measures the verdict (verdict.py: the global norm and finiteness) as backward produces the
gradients; a non-finite verdict skips the step. Each pass is opened with a `step_log.StepPass`, which tells
the updater what to do with each chunk's gradient. An exception anywhere in a step undoes what the step applied
(what the transaction can undo), frees its buffers and re-raises (step.py).
"""
from __future__ import annotations

import time
import warnings
from typing import NamedTuple

import torch

from ..optim import Hyper
from .step_log import ACCUMULATE, APPLY, DEFER, MEASURE, SPECULATE, SPECULATE_KEEPING, StepPass
from .timed_switch import CORRECTED, DEFERRED, SPECULATED, TimedSwitch, above_break_even

# Each transaction is handed the Stepper (`st`: the step's runner, verdict, updater and buffers) and reads it by
# its fields; it does not import step.py, which picks the transaction (`for_plan`): the arrow runs one way.


class Outcome(NamedTuple):
    loss: torch.Tensor
    norm: float          # the global norm of the unscaled gradient
    coef: float          # the clip coefficient
    finite: bool         # False: the step is skipped


class Transaction:
    """How a step runs its passes, what it keeps, how it commits and rolls back (the subclasses below)."""
    reruns = False       # the step may run forward again: the stepper saves the model's buffers first
    deferring = False    # the step running (or last run) applies its updates after the verdict: `MayDefer`

    def __init__(self, name: str):
        self.name = name

    def run(self, st, batches: list, hyper: Hyper, tangent: torch.Tensor, saved: list | None) -> Outcome:
        """The step's passes and its verdict; on return the step is ready to commit. `hyper` has the loss scale
        as its grad_scale; `saved`: the model's buffers before the step (when `reruns`)."""
        raise NotImplementedError

    def roll_back(self, st, batches: list, tangent: torch.Tensor, saved: list | None) -> bool:
        """After an exception: True if the step was rolled back here; False leaves it to the updater's abandon,
        which undoes every update it can (the kept gradients or accumulators it needs are intact)."""
        return False

    def failed(self) -> None:
        """The step did not commit (an exception, or rolled back): what the transaction learns from its steps
        forgets it (MayDefer's timed switch)."""


def _guess(st) -> float:
    """The clip coefficient a speculated step updates with: the last step's (1.0 without clipping)."""
    return st.last_coef if st.config.grad_clip is not None else 1.0


def _speculate(st, batch, hyper: Hyper, tangent, kind: StepPass) -> tuple[float, Outcome]:
    """One pass updating each chunk inside backward with a guessed clip coefficient; returns (guess, outcome).
    The guess is the last step's coefficient: norms change slowly, so a correction then moves each update a little,
    and its undo loses nothing to cancellation (undoing a step speculated at 1 that should have been 0.01 would
    subtract nearly equal numbers)."""
    scale = hyper.grad_scale
    guess = _guess(st)
    st.updater.open(hyper.scaled(scale / guess), kind)
    loss = st.run_pass(batch, tangent)
    return guess, Outcome(loss, *st.verdict(scale))


class KeptGrads(Transaction):
    """kept_grads: each chunk is updated inside backward with the guessed clip coefficient (speculation) and its
    gradient kept (on the device with spare room, else on the host; a host chunk's where it landed) until the
    verdict, which then commits, corrects every update by the clip coefficient (one rescale pass per chunk) or rolls
    them back (a skipped step). Costs the kept gradients' memory; a correction costs one pass over each updated
    chunk."""

    def run(self, st, batches, hyper, tangent, saved):
        guess, out = _speculate(st, batches[0], hyper, tangent, SPECULATE_KEEPING)
        if not out.finite:
            st.updater.rollback()
        elif out.coef != guess:
            st.updater.correct(hyper.scaled(hyper.grad_scale / out.coef))
        return out


class Replay(Transaction):
    """replay: like kept_grads, but nothing is kept. A step that must be corrected or rolled back restores the
    masters from the updated moments and runs forward and backward again, whose gradients restore the moments
    (and apply the corrected update): free unless it triggers, then about one more step. An exception is rolled
    back the same way (a replay that only restores). A host Adam failure after the step returned cannot be undone.
    Also a "two_pass" step with nothing to measure first (no clipping, no loss scaling, undoable moments), which
    runs as one pass: its skip must change nothing all the same (`plan.two_passes` false)."""
    reruns = True

    def run(self, st, batches, hyper, tangent, saved):
        guess, out = _speculate(st, batches[0], hyper, tangent, SPECULATE)
        if not out.finite or out.coef != guess:
            right = hyper.scaled(hyper.grad_scale / out.coef) if out.finite else None   # None: must not apply
            self._run_again(st, batches[0], tangent, saved, right)
        return out

    def roll_back(self, st, batches, tangent, saved):
        up = st.updater
        if up.step_log is None or up.step_log.kind is not SPECULATE or not batches:
            return False
        # nothing was kept: roll the applied updates back by replaying the step (only restoring); the buffers
        # were saved before the speculative pass opened this log
        try:
            if up.applied_chunks():
                self._run_again(st, batches[0], tangent, saved, None)
            up.commit()
            return True
        except BaseException as e:
            st.rt.clear()
            up.step_log = None
            raise RuntimeError("a failed step could not be rolled back by replaying it (transaction 'replay' "
                               f"keeps no gradients): {type(e).__name__}: {e}; the weights are partly "
                               "updated") from e

    @staticmethod
    def _run_again(st, batch, tangent, saved, hyper: Hyper | None) -> None:
        """Restore the masters, then run the step again: its gradients restore the moments and, with `hyper`,
        apply the right update (the guess was wrong) — without it, only restore (a skipped step)."""
        t0 = time.perf_counter()
        up = st.updater
        up.restore_masters()
        st.restore_buffers(saved)
        up.open_replay(hyper)
        st.run_pass(batch, tangent)
        st.rt.mover.check_idle()
        st.rt.telemetry.add("correction", time.perf_counter() - t0)


class Deferred(Transaction):
    """deferred: each chunk's gradient is kept (a host chunk's possibly in its 16-bit shadow) and nothing is
    updated inside backward; after the verdict every update is applied from the kept gradients, exactly: no undo,
    what bf16 and int8 moments need. The host Adam runs after backward, into the next step's forward."""

    def run(self, st, batches, hyper, tangent, saved):
        st.updater.open(hyper, DEFER)
        out = Outcome(st.run_pass(batches[0], tangent), *st.verdict(hyper.grad_scale))
        if out.finite:
            st.updater.apply_deferred(hyper.scaled(hyper.grad_scale / out.coef))
        else:
            st.updater.skip_deferred()
        return out


class TwoPass(Transaction):
    """two_pass (`plan.two_passes`): a first pass measures the verdict and updates nothing; a second pass applies
    exactly (bf16 or int8 moments, which cannot be undone, or random ops a replay would redraw otherwise). A skipped
    step changes nothing; an exception in the second pass leaves the chunks it updated (they cannot be undone)."""
    reruns = True

    def run(self, st, batches, hyper, tangent, saved):
        st.updater.open(hyper, MEASURE)
        out = Outcome(st.run_pass(batches[0], tangent), *st.verdict(hyper.grad_scale))
        if out.finite:
            st.restore_buffers(saved)          # the measuring pass must not move BatchNorm twice
            st.updater.open(hyper.scaled(hyper.grad_scale / out.coef), APPLY)
            out = out._replace(loss=st.run_pass(batches[0], tangent))
        return out


class NoTransaction(Transaction):
    """none: updates are applied as they come; a non-finite gradient or an exception leaves the chunks already
    updated (a warning says so). No clipping (the norm is known only after the updates)."""

    def run(self, st, batches, hyper, tangent, saved):
        _, out = _speculate(st, batches[0], hyper, tangent, APPLY)
        if not out.finite:
            warnings.warn("non-finite gradients with transaction 'none': the chunks updated before "
                          "they were found stay updated", RuntimeWarning, stacklevel=4)
        return out


class Accumulate(Transaction):
    """accumulate (grad_accum > 1, whatever the configured choice): each chunk's gradients are summed into an fp32
    accumulator on its tier over the micro-batches, the last micro-batch measures the sum, and every update is
    applied after the verdict, from the accumulators (an exception undoes them from there)."""

    def run(self, st, batches, hyper, tangent, saved):
        up = st.updater
        up.open(hyper, ACCUMULATE)
        losses = []
        for j, mb in enumerate(batches):
            up.micro(first=j == 0, last=j == len(batches) - 1)
            st.rt.rng.start_micro(j)
            losses.append(st.run_pass(mb, tangent))
        out = Outcome(torch.stack(losses).mean(), *st.verdict(hyper.grad_scale))
        if out.finite:
            up.apply_accumulated(hyper.scaled(hyper.grad_scale / out.coef))
        return out


class MayDefer(Transaction):
    """A speculating transaction chosen by "auto" with clipping (`plan.defer_above`): each step either speculates
    (kept_grads, replay) or lets its updates wait for the verdict (kept_grads: deferred, from the same kept
    gradients; replay: two_pass, measuring first, which needs no buffer a replay lacks), by the expected trigger
    rate (Stepper.expected_trigger_rate): above the plan's break-even, waiting costs less than the corrections
    expected. With a `switch` (timed_switch.py), by the steps this run has timed, once it has timed some. Each is
    exact, and they need the same buffers, so a step may switch without recompiling and changes no result."""

    def __init__(self, name: str, defer_above: float | None, switch: TimedSwitch | None = None):
        super().__init__(name)
        self.defer_above, self.switch = defer_above, switch
        self._speculate, self._defer = ((KeptGrads(name), Deferred(name)) if name == "kept_grads" else
                                        (Replay(name), TwoPass(name)))
        self.reruns = self._speculate.reruns or self._defer.reruns

    @property
    def _running(self) -> Transaction:
        return self._defer if self.deferring else self._speculate

    def run(self, st, batches, hyper, tangent, saved):
        rate = st.expected_trigger_rate()
        if self.switch is None:
            self.deferring = above_break_even(self.defer_above, rate)
            return self._running.run(st, batches, hyper, tangent, saved)
        shape = tuple(tuple(x.shape) for x in batches[0] if isinstance(x, torch.Tensor))
        self.deferring = self.switch.defer(rate, shape)
        guess, t0 = _guess(st), self.switch.clock()     # (a speculated step that guessed wrong is corrected)
        out = self._running.run(st, batches, hyper, tangent, saved)
        kind = (None if not out.finite else DEFERRED if self.deferring else
                CORRECTED if out.coef != guess else SPECULATED)
        self.switch.record(kind, self.switch.clock() - t0)
        return out

    def roll_back(self, st, batches, tangent, saved):
        return self._running.roll_back(st, batches, tangent, saved)

    def failed(self) -> None:
        if self.switch is not None:
            self.switch.forget_last()       # the next step is not steady


_BY_NAME = {"kept_grads": KeptGrads, "replay": Replay, "deferred": Deferred, "two_pass": TwoPass,
            "none": NoTransaction, "accumulate": Accumulate}


def for_plan(transaction: str, two_passes: bool, defer_above: float | None = None,
             switch: TimedSwitch | None = None) -> Transaction:
    """The object for `plan.transaction`; a "two_pass" plan that measures nothing first runs as a replay, and a
    kept_grads or replay plan with `plan.defer_above` (or a `switch`: the plan priced deferring, which the run may
    find cheaper than planned) may defer step by step."""
    if transaction == "two_pass" and not two_passes:
        return Replay(transaction)
    if transaction in ("kept_grads", "replay") and (defer_above is not None or switch is not None):
        return MayDefer(transaction, defer_above, switch)
    return _BY_NAME[transaction](transaction)
