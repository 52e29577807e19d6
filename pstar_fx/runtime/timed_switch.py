"""timed_switch: a step that may defer (transactions.MayDefer) chooses by the steps this run has timed.

The plan prices three kinds of step: speculated (clipping did not trigger), speculated then corrected (it did),
and deferred (updates after the verdict, from the same kept gradients; a replay plan's: measuring first). Its
break-even (`plan.defer_above`) is only as good as those prices, and the after-verdict host Adam is the hardest to
price: on an H100 at Llama-3-8B's shape the plan priced a deferred step 2.19 s and a corrected one 2.15 s, so a run
clipping every step speculated, where the box ran them in 1.83 s and 2.17 s (bench/RESULTS.md, sessions 39 and 41).

So the runtime times them. A step's seconds (its `run`, from its first launch through the verdict to the last
launch after it) hold the previous step's work that spilled into its forward (a deferred host Adam, a correction's
host chunks): a step is counted for its kind only after a step of the same kind (steady). A kind is timed once it
has MIN_SAMPLES steady steps, its cost the median of its last SAMPLES; a kind not timed yet is priced at the plan's
estimate scaled by how the timed kinds came out against theirs. At the expected trigger rate r, speculating costs
speculated + r x (corrected - speculated) and deferring costs deferred; the cheaper runs. Where clipping is
expected on most steps (r >= PROBE_RATE: the corrections, the plan's least sure price, weigh most) and the way not
taken has never been timed and is priced within MARGIN of the way taken, it runs PROBE steps (the last PROBE - 1 of
them steady) to be timed, once. Each way is exact and uses the same buffers, so the choice changes no result.

Each input shape (sequence length) is timed on its own: a step's seconds depend on it.

On the CUDA runtime of one process (`timed_switch_on`: PSTAR_FX_TIMED_SWITCH, "1" by default). The CPU runtime's
host Adam is inline, so its ways cost alike, and ranks of a data-parallel run must choose alike: both keep the
plan's break-even alone.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque

from ..config import parse_flag

log = logging.getLogger("pstar_fx")

SPECULATED, CORRECTED, DEFERRED = "speculated", "corrected", "deferred"
SAMPLES = 5         # steady steps kept for each kind (their median is its cost)
MARGIN = 1.25       # a way never timed is probed where priced within this factor of the way taken
PROBE_RATE = 0.5    # ... and only at an expected trigger rate of at least this
SETTLE = 2          # the run's first steps (allocator, caches, first launches) are not timed
MIN_SAMPLES = 2     # a kind is timed once it has this many steady steps (one alone misled call M: RESULTS s41)
PROBE = MIN_SAMPLES + 1   # steps a way never timed runs to be timed (its first is not steady)


def above_break_even(defer_above: float | None, rate: float) -> bool:
    """The plan's rule: defer while the expected trigger rate is above its break-even (None: never)."""
    return defer_above is not None and rate > defer_above


def timed_switch_on() -> bool:
    """PSTAR_FX_TIMED_SWITCH: "1" (default) a step that may defer chooses by timed steps; "0" by the plan alone."""
    return parse_flag(os.environ.get("PSTAR_FX_TIMED_SWITCH", "1"), "PSTAR_FX_TIMED_SWITCH")


class _Timings:
    """One input shape's timed steps (a step's seconds depend on its sequence length: pipeline/shapes.py) and its
    probes."""

    def __init__(self):
        self.samples = {k: deque(maxlen=SAMPLES) for k in (SPECULATED, CORRECTED, DEFERRED)}
        self.probing: bool | None = None  # the way being probed (True: deferring) while `probe_left`
        self.probe_left = 0
        self.probed: set[bool] = set()    # ways probed once already
        self.said: bool | None = None     # the last choice logged against the plan's


class TimedSwitch:
    """Whether the next step defers, by the plan's estimates (`estimates`: seconds of each kind) and `defer_above`
    until steps of its input shape are timed, then by those timed steps (`record`)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, estimates: dict[str, float], defer_above: float | None):
        self.estimates = dict(estimates)
        self.defer_above = defer_above
        self.shapes: dict[object, _Timings] = {}
        self.shape: object = None         # the input shape of the step chosen last
        self.seen = 0                     # steps recorded (timed or not), of any shape
        self.last_kind: str | None = None

    @property
    def now(self) -> _Timings:
        return self.shapes.setdefault(self.shape, _Timings())

    # ---- what each kind costs (at the last chosen step's shape) ------------------------------------------------
    def timed(self, kind: str) -> float | None:
        s = self.now.samples[kind]
        return statistics.median(s) if len(s) >= MIN_SAMPLES else None

    def seconds(self, kind: str) -> float:
        """The kind's timed cost, or its estimate scaled by the median of timed / estimated over the timed kinds."""
        timed = self.timed(kind)
        if timed is not None:
            return timed
        ratios = [self.timed(k) / self.estimates[k] for k in self.now.samples
                  if self.timed(k) is not None and self.estimates.get(k)]
        return self.estimates[kind] * (statistics.median(ratios) if ratios else 1.0)

    def cost(self, defer: bool, rate: float) -> float:
        if defer:
            return self.seconds(DEFERRED)
        return self.seconds(SPECULATED) + rate * (self.seconds(CORRECTED) - self.seconds(SPECULATED))

    # ---- the choice -----------------------------------------------------------------------------------------
    def defer(self, rate: float, shape: object = None) -> bool:
        """Whether the next step (of input `shape`) defers at expected trigger rate `rate`."""
        self.shape = shape
        at = self.now
        if at.probe_left:
            return at.probing
        if all(self.timed(k) is None for k in at.samples):
            return above_break_even(self.defer_above, rate)
        defer = self.cost(True, rate) < self.cost(False, rate)
        other = not defer
        never_timed = self.timed(DEFERRED if other else CORRECTED) is None    # (the kind it runs at PROBE_RATE)
        if (rate >= PROBE_RATE and other not in at.probed and never_timed
                and self.cost(other, rate) <= MARGIN * self.cost(defer, rate)):
            at.probing, at.probe_left = other, PROBE
            at.probed.add(other)
            log.info("pstar_fx: timing %d %s steps (priced %.3g s against %.3g s %s, timed)", PROBE,
                     "deferred" if other else "speculated", self.cost(other, rate), self.cost(defer, rate),
                     "deferred" if defer else "speculated")
            return other
        planned = above_break_even(self.defer_above, rate)
        if defer != planned and at.said is not defer:
            log.info("pstar_fx: %s at an expected trigger rate of %.0f%%, by this run's timed steps (%s); the plan's "
                     "break-even said %s", "deferring" if defer else "speculating", rate * 100, self.summary(),
                     "defer" if planned else "speculate")
        at.said = defer
        return defer

    def record(self, kind: str | None, seconds: float) -> None:
        """The step just chosen has run: its kind (None: skipped or failed, which times nothing) and its seconds.
        Steady only after a step of the same kind, whatever that step's shape (its spill is of that kind)."""
        self.seen += 1
        at = self.now
        if at.probe_left:
            at.probe_left -= 1
        if kind is not None and kind == self.last_kind and self.seen > SETTLE:
            at.samples[kind].append(seconds)
        self.last_kind = kind

    def forget_last(self) -> None:
        """A failed step: the next one is not steady."""
        self.last_kind = None

    def summary(self) -> str:
        """Each kind's cost at the last chosen step's shape, timed (with its count) or planned."""
        samples = self.now.samples
        return ", ".join(f"{k} {self.timed(k):.3g} s timed over {len(samples[k])}" if self.timed(k) is not None
                         else f"{k} {self.estimates[k]:.3g} s planned" for k in samples)
