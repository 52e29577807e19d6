"""step: one optimizer step as a transaction — the step's counts, learning rate and loss scale; its passes are the
transaction's (transactions.py: one class per transaction, which says how a step runs, keeps, commits and rolls
back). A step's updates are provisional until it commits. An exception anywhere in a step undoes what the step
applied, frees its buffers and re-raises, with the step count, schedule and loss scale as they were.
Hyperparameters (step, lr, loss scale, clip coefficient) are frozen into a `Hyper` per step.
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from ..optim import Hyper, LossScaler, LrSchedule, clip_coefficient
from .chunk_ops import ChunkRuntime
from .step_log import StepRolledBack
from .timed_switch import CORRECTED, DEFERRED, SPECULATED, TimedSwitch, timed_switch_on
from .transactions import for_plan


@dataclass(frozen=True)
class StepReport:
    """What one `engine.step` did (`engine.last_step`)."""
    loss: float              # the step's loss (the mean over its micro-batches)
    grad_norm: float | None  # global L2 norm of the (unscaled) gradient, before clipping
    clip_coef: float         # the factor the gradient was multiplied by (1.0: not clipped)
    skipped: bool            # a non-finite gradient: nothing was updated
    lr: float                # the learning rate this step used
    loss_scale: float        # the loss scale this step used (1.0 without loss scaling)
    deferred: bool = False   # its updates waited for the verdict (a kept_grads plan that may defer: plan.defer_above)


# The expected trigger rate, measured (Config.expected_trigger_rate None): the share of the last TRIGGER_WINDOW
# applied steps whose clipping triggered, the steps not yet run counted as triggering (a run's first steps clip).
TRIGGER_WINDOW = 8


def _timed_switch(rt: ChunkRuntime, transaction: str) -> TimedSwitch | None:
    """A kept_grads or replay plan that priced deferring (chosen by "auto" with clipping) chooses step by step by
    timed steps (timed_switch.py) on the CUDA runtime of one process; None: by the plan's break-even alone."""
    est = rt.plan.estimate
    if (transaction not in ("kept_grads", "replay") or est.deferred_step_seconds is None
            or rt.device.type != "cuda" or rt.dp is not None or not timed_switch_on()):
        return None
    return TimedSwitch({SPECULATED: est.step_seconds, CORRECTED: est.triggered_step_seconds,
                        DEFERRED: est.deferred_step_seconds}, rt.plan.defer_above)


class Stepper:
    """Runs optimizer steps on a runtime: owns the applied-update count, the schedule and the loss scaler."""

    def __init__(self, rt: ChunkRuntime, config, transaction: str,
                 run: Callable[[list, torch.Tensor], torch.Tensor], buffers: list[torch.Tensor]):
        self.rt, self.config, self._run = rt, config, run
        self.transaction = for_plan(transaction, rt.plan.two_passes, rt.plan.defer_above,
                                    _timed_switch(rt, transaction))
        self.buffers = buffers
        self.schedule = LrSchedule(config.lr_schedule, config.optimizer["lr"])
        self.scaler = LossScaler(config.loss_scaler_spec)
        self.applied = 0                        # updates applied: Adam's step count and the schedule's position
        self._before_settling: tuple | None = None   # (applied, scaler state) before a step still settling
        self.last_coef = 1.0                    # the last applied step's clip coefficient: the next one's guess
        self.recent_clips: deque[bool] = deque(maxlen=TRIGGER_WINDOW)   # whether each recent step's clipping triggered

    @property
    def lr(self) -> float:
        return self.schedule.lr(self.applied)

    @property
    def updater(self):
        return self.rt.updater

    def state_dict(self) -> dict:
        """The loop state a resume needs (a checkpoint's JSON)."""
        return {"step": self.applied, "loss_scale": self.scaler.state_dict(), "last_clip_coef": self.last_coef,
                "recent_clips": list(self.recent_clips)}

    def load_state_dict(self, state: dict | None) -> None:
        """`None`: a fresh start (step 0, the initial loss scale)."""
        state = state or {}
        self.applied = int(state.get("step", 0))
        self.last_coef = float(state.get("last_clip_coef", 1.0))
        self.recent_clips = deque((bool(x) for x in state.get("recent_clips", [])), maxlen=TRIGGER_WINDOW)
        self.scaler = LossScaler(self.config.loss_scaler_spec)
        self.scaler.load_state_dict(state.get("loss_scale", {}))
        self._before_settling = None

    def step(self, micro_batches: list[list[torch.Tensor]],
             run: Callable[[list, torch.Tensor], torch.Tensor] | None = None) -> StepReport:
        """`run`: forward and backward of the graph for these micro-batches' shapes (pipeline/shapes.py); the
        step state here (count, schedule, loss scale, clipping's history) is the same whichever graph runs."""
        if run is not None:
            self._run = run
        rt, up = self.rt, self.rt.updater
        scale = self.scaler.scale
        lr = self.lr
        hyper = Hyper.from_config(self.config.optimizer, step=self.applied + 1, lr=lr, grad_scale=scale)
        rt.rng.start_step(self.applied + 1)             # random ops redraw alike whenever this step reruns
        world = rt.dp.world if rt.dp is not None else 1
        tangent = torch.tensor(scale / (len(micro_batches) * world), dtype=torch.float32)   # ranks' gradients summed
        before = (self.applied, self.scaler.state_dict())
        saved = None                                     # buffers as the step found them (a rerun restores them)
        rt.copies.start_step()
        try:
            if self.transaction.reruns:
                saved = [b.clone() for b in self.buffers]
            loss, norm, coef, finite = self.transaction.run(self, micro_batches, hyper, tangent, saved)
            rt.mover.check_idle()
            loss_value = float(loss if rt.dp is None else rt.dp.mean(loss))   # the whole batch's loss
            up.commit()
        except StepRolledBack:
            rt.clear()
            self.transaction.failed()
            self._abandon()
            self.rolled_back()
            raise
        except BaseException:
            rt.clear()
            self.transaction.failed()
            if not self.transaction.roll_back(self, micro_batches, tangent, saved):
                self._abandon()
            raise
        self._before_settling = before if up.settling is not None else None
        self.scaler.update(found_inf=not finite)
        if finite:
            self.applied += 1
            self.last_coef = coef
            self.recent_clips.append(coef < 1.0)
        rt.telemetry.count_step()
        return StepReport(loss=loss_value, grad_norm=norm, clip_coef=coef if finite else 1.0, skipped=not finite,
                          lr=lr, loss_scale=scale, deferred=self.transaction.deferring)

    # ---- for the transactions ------------------------------------------------------------------------
    def expected_trigger_rate(self) -> float:
        """The share of steps whose clipping is expected to trigger: Config.expected_trigger_rate, or measured over
        the last TRIGGER_WINDOW steps (those not yet run count as triggering)."""
        if self.config.expected_trigger_rate is not None:
            return self.config.expected_trigger_rate
        return (sum(self.recent_clips) + TRIGGER_WINDOW - len(self.recent_clips)) / TRIGGER_WINDOW

    def run_pass(self, inputs: list[torch.Tensor], tangent: torch.Tensor) -> torch.Tensor:
        """Forward and backward over one micro-batch (the chunk updates run inside backward); returns the loss."""
        with record_function("pstar_fx.pass"):
            loss = self._run(inputs, tangent)
        self.rt.updater.pass_queued()
        return loss

    def verdict(self, scale: float) -> tuple[float, float, bool]:
        """(the global norm of the unscaled gradient, the clip coefficient, whether it is finite)."""
        sq = self.rt.updater.verdict() / (scale * scale)
        norm, coef = clip_coefficient(sq, self.config.grad_clip)
        return norm, coef, math.isfinite(norm)

    def restore_buffers(self, saved: list[torch.Tensor]) -> None:
        for b, s in zip(self.buffers, saved):
            b.copy_(s)

    def _abandon(self) -> None:
        up = self.rt.updater
        up.abandon()
        if up.settling_rolled_back:
            self.rolled_back()
        if up.undo.not_undone:
            warnings.warn(f"the failed step had updated {len(up.undo.not_undone)} chunk(s) that transaction "
                          f"{self.transaction.name!r} cannot undo; they stay updated", RuntimeWarning, stacklevel=4)

    def rolled_back(self) -> None:
        """The step before, still settling, was rolled back: it did not happen (counts and scale as before it)."""
        if self._before_settling is not None:
            self.applied, state = self._before_settling
            self.scaler.load_state_dict(state)
            self._before_settling = None
