"""step: one optimizer step as a transaction — micro-batches, the verdict, then commit or roll back.

A step's updates are provisional until it commits. The plan chose how (`plan.transaction`):

  kept_grads  each chunk is updated inside backward with clip coefficient 1 (speculation) and its gradient
              kept; the verdict (global norm, finiteness) then commits, corrects the updates by the clip
              coefficient (undo + redo per chunk) or rolls them back (a skipped step);
  replay      like kept_grads, but nothing is kept: a step that must be corrected or rolled back restores
              the masters from the moments and runs forward and backward again, whose gradients restore the
              moments (and apply the corrected update). Free unless it triggers; then about one more step;
  deferred    each chunk's gradient is kept and nothing updated inside backward; after the verdict every update
              is applied from the kept gradients, exactly (no undo: what bf16 and int8 moments need);
  two_pass    a first pass measures the verdict and updates nothing; a second pass applies exactly (always
              two passes with bf16 or int8 moments, which cannot be undone: a skipped step changes nothing).
              With nothing to measure (no clipping, no loss scaling, fp32 moments) one pass, rolled back
              like replay's when its gradient is non-finite or it fails (two passes when it cannot be
              replayed: plan.two_passes);
  none        updates are applied as they come; a non-finite gradient or an exception leaves the chunks
              already updated (the engine warns);
  an accumulating step (grad_accum > 1) sums each chunk's gradients into fp32 accumulators over its
              micro-batches and applies every update after the verdict, from them, whatever the choice.

An exception anywhere in a step (forward, backward after some chunks were updated, the host Adam) undoes
what the step applied, frees its buffers and re-raises, with the step count, schedule and loss scale as
they were. Hyperparameters (step, lr, loss scale, clip coefficient) are frozen into a `Hyper` per step.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..optim import Hyper, LossScaler, LrSchedule, clip_coefficient
from . import ChunkRuntime, StepRolledBack


@dataclass(frozen=True)
class StepReport:
    """What one `engine.step` did (`engine.last_step`)."""
    loss: float              # the step's loss (the mean over its micro-batches)
    grad_norm: float | None  # global L2 norm of the (unscaled) gradient, before clipping
    clip_coef: float         # the factor the gradient was multiplied by (1.0: not clipped)
    skipped: bool            # a non-finite gradient: nothing was updated
    lr: float                # the learning rate this step used
    loss_scale: float        # the loss scale this step used (1.0 without loss scaling)


class Stepper:
    """Runs optimizer steps on a runtime: owns the applied-update count, the schedule and the loss scaler."""

    def __init__(self, rt: ChunkRuntime, config, transaction: str,
                 run: Callable[[list, torch.Tensor], torch.Tensor], buffers: list[torch.Tensor]):
        self.rt, self.config, self.transaction, self._run = rt, config, transaction, run
        self.buffers = buffers
        self.schedule = LrSchedule(config.lr_schedule, config.optimizer["lr"])
        self.scaler = LossScaler(config.loss_scaler_spec)
        self.applied = 0                        # updates applied: Adam's step count and the schedule's position
        self._before_settling: tuple | None = None   # (applied, scaler state) before a step still settling
        self._last_coef = 1.0                   # the last applied step's clip coefficient: the next one's guess
        # a step that must be rolled back or corrected is run again ("replay"); so is a "two_pass" step with
        # nothing to measure first (no clipping, no loss scaling, undoable moments) that can be replayed, which
        # runs as one pass: its skip must change nothing all the same (plan.two_passes: the other two_pass steps)
        self._two_passes = rt.plan.two_passes
        self._replays = transaction == "replay" or (transaction == "two_pass" and not self._two_passes)

    @property
    def lr(self) -> float:
        return self.schedule.lr(self.applied)

    def state_dict(self) -> dict:
        """The loop state a resume needs (a checkpoint's JSON)."""
        return {"step": self.applied, "loss_scale": self.scaler.state_dict(), "last_clip_coef": self._last_coef}

    def load_state_dict(self, state: dict | None) -> None:
        """`None`: a fresh start (step 0, the initial loss scale)."""
        state = state or {}
        self.applied = int(state.get("step", 0))
        self._last_coef = float(state.get("last_clip_coef", 1.0))
        self.scaler = LossScaler(self.config.loss_scaler_spec)
        self.scaler.load_state_dict(state.get("loss_scale", {}))
        self._before_settling = None

    def step(self, micro_batches: list[list[torch.Tensor]]) -> StepReport:
        rt, up, cfg = self.rt, self.rt.updater, self.config
        scale = self.scaler.scale
        lr = self.lr
        hyper = Hyper.from_config(cfg.optimizer, step=self.applied + 1, lr=lr, grad_scale=scale)
        rt.rng.step, rt.rng.micro = self.applied + 1, 0   # random ops redraw alike whenever this step reruns
        k = len(micro_batches)
        world = rt.dp.world if rt.dp is not None else 1
        tangent = torch.tensor(scale / (k * world), dtype=torch.float32)   # ranks' gradients are summed
        before = (self.applied, self.scaler.state_dict())
        saved = None                                     # buffers as the step found them (a replay restores them)
        rt.copies.start_step()
        try:
            if k > 1:
                up.open(hyper, "accumulate")
                losses = []
                for j, mb in enumerate(micro_batches):
                    up.micro(first=j == 0, last=j == k - 1)
                    rt.rng.micro = j
                    losses.append(self._run(mb, tangent))
                loss = torch.stack(losses).mean()
                norm, coef, finite = self._verdict(scale)
                if finite:
                    up.apply_accumulated(hyper.scaled(scale / coef))
            elif self.transaction == "deferred":
                up.open(hyper, "defer")
                loss = self._run(micro_batches[0], tangent)
                norm, coef, finite = self._verdict(scale)
                if finite:
                    up.apply_deferred(hyper.scaled(scale / coef))
                else:
                    up.skip_deferred()
            elif self._two_passes:
                saved = [b.clone() for b in self.buffers]   # the measuring pass must not move BatchNorm twice
                up.open(hyper, "measure")
                loss = self._run(micro_batches[0], tangent)
                norm, coef, finite = self._verdict(scale)
                if finite:
                    for b, s in zip(self.buffers, saved):
                        b.copy_(s)
                    up.open(hyper.scaled(scale / coef), "apply")
                    loss = self._run(micro_batches[0], tangent)
            else:
                # Speculate with the last step's clip coefficient: norms change slowly, so a correction then
                # moves each update a little, and its undo loses nothing to cancellation (undoing a step
                # speculated at 1 that should have been 0.01 would subtract nearly equal numbers)
                if self._replays:
                    saved = [b.clone() for b in self.buffers]
                guess = self._last_coef if cfg.grad_clip is not None else 1.0
                up.open(hyper.scaled(scale / guess),
                        "speculate" if self.transaction == "kept_grads" or self._replays else "apply")
                loss = self._run(micro_batches[0], tangent)
                norm, coef, finite = self._verdict(scale)
                right = hyper.scaled(scale / coef) if finite else None     # None: the step must not apply
                if self._replays:
                    if right is None or coef != guess:
                        self._replay(micro_batches[0], tangent, saved, right)
                elif right is None:
                    if self.transaction == "kept_grads":
                        up.rollback()
                    else:
                        warnings.warn("non-finite gradients with transaction 'none': the chunks updated before "
                                      "they were found stay updated", RuntimeWarning, stacklevel=3)
                elif coef != guess:
                    up.correct(right)
            rt.mover.check_idle()
            loss_value = float(loss if rt.dp is None else rt.dp.mean(loss))   # the whole batch's loss
            up.commit()
        except StepRolledBack:
            self._abandon()
            self.rolled_back()
            raise
        except BaseException:
            self._abandon(micro_batches, tangent, saved)
            raise
        self._before_settling = before if up.settling is not None else None
        self.scaler.update(found_inf=not finite)
        if finite:
            self.applied += 1
            self._last_coef = coef
        self.rt.telemetry.steps += 1
        return StepReport(loss=loss_value, grad_norm=norm, clip_coef=coef if finite else 1.0, skipped=not finite,
                          lr=lr, loss_scale=scale)

    def _verdict(self, scale: float) -> tuple[float, float, bool]:
        sq = self.rt.updater.verdict() / (scale * scale)
        norm, coef = clip_coefficient(sq, self.config.grad_clip)
        return norm, coef, math.isfinite(norm)

    def _replay(self, inputs, tangent, saved_buffers, hyper: Hyper | None) -> None:
        """Restore the masters, then run the step again: its gradients restore the moments and, with
        `hyper`, apply the right update (the guess was wrong) — without it, only restore (a skipped step)."""
        t0 = time.perf_counter()
        up = self.rt.updater
        up.restore_masters()
        for b, s in zip(self.buffers, saved_buffers):
            b.copy_(s)
        up.open_replay(hyper)
        self._run(inputs, tangent)
        self.rt.mover.check_idle()
        self.rt.telemetry.add("correction", time.perf_counter() - t0)

    def _abandon(self, micro_batches=None, tangent=None, before_buffers=None) -> None:
        self.rt.clear()
        up = self.rt.updater
        log = up.log
        if self._replays and log is not None and log.mode == "speculate" and micro_batches:
            # nothing was kept: roll the applied updates back by replaying the step (only restoring); the
            # buffers were saved before the speculative pass opened this log
            try:
                if up.applied_chunks(log):
                    self._replay(micro_batches[0], tangent, before_buffers, None)
                up.commit()
                return
            except BaseException as e:
                self.rt.clear()
                up.log = None
                raise RuntimeError("a failed step could not be rolled back by replaying it (transaction 'replay' "
                                   f"keeps no gradients): {type(e).__name__}: {e}; the weights are partly "
                                   "updated") from e
        up.abandon()
        if up.settling_rolled_back:
            self.rolled_back()
        if up.not_undone:
            warnings.warn(f"the failed step had updated {len(self.rt.updater.not_undone)} chunk(s) that transaction "
                          f"{self.transaction!r} cannot undo; they stay updated", RuntimeWarning, stacklevel=4)

    def rolled_back(self) -> None:
        """The step before, still settling, was rolled back: it did not happen (counts and scale as before it)."""
        if self._before_settling is not None:
            self.applied, state = self._before_settling
            self.scaler.load_state_dict(state)
            self._before_settling = None
