"""host_rate: the host Adam's rate as training runs it, against the rate its plan assumed; where the two differ by
more than `TOLERANCE`, the next compile on this machine plans with the measured one (planning/costs.py
`learn_host_rate`, `PSTAR_FX_LEARN_RATES=0` to switch it off).

Why: the calibration times the host Adam alone, for a fraction of a second, on buffers of its own; training runs it
for seconds a step beside PCIe copies, on a host whose memory bandwidth other tenants of the machine share. On the
H200 boxes the calibration gave the bf16-moment Adam 7.0-10.4 G params/s alone from one box to the next, while
training ran it at 6.2-7.4 (bench/RESULTS.md, session 24), and a plan made at the calibrated rate left half of
GPT3_18B's chunks to be updated after the verdict where the measured rate keeps a quarter there.

The rate learned is the one alone that, beside the same copies, would have given the measured one: the measured
rate over the share of its rate alone the plan gave the host Adam beside the step's copies (planning/costs.py
`host_adam_share`), so a later plan, whatever its copies, prices its own share from it.
"""
from __future__ import annotations

import logging

import torch

from ..planning.costs import calibrated_rates, learn_host_rate, learning_host_rates
from .telemetry import Telemetry

log = logging.getLogger("pstar_fx")

# steps whose host Adam is measured: from the end of the first (page faults, first kernels, the host buffers'
# first use in the second) to the end of the last; a step on another plan inside it starts it again
WINDOW = (2, 6)
TOLERANCE = 0.10          # a measured rate this close to the plan's changes nothing


class HostRateCheck:
    """After `WINDOW[1]` steps, the host Adam's measured rate (whole updates of host chunks, `Telemetry.adam_done`)
    against the plan's (`Estimate.host_adam_rate`); `measured`, `assumed` and `learned` (parameters/s; None until
    then, `learned` None where nothing was learned)."""

    def __init__(self, estimate, optimizer_state: str, device: torch.device, dtype: torch.dtype,
                 telemetry: Telemetry, learns: bool = True):
        self.assumed = estimate.host_adam_rate or None              # beside the step's copies; 0: no host chunk
        self.alone = estimate.rates.host_adam_with(optimizer_state) if estimate.rates is not None else 0.0
        self.state, self.device, self.dtype, self.telemetry = optimizer_state, device, dtype, telemetry
        self.learns = learns
        self.measured: float | None = None
        self.learned: float | None = None
        self._start: tuple[int, int, float] | None = None     # (steps, elems, seconds) where the window began
        self._done = not (self.assumed and self.alone)

    def after_step(self, on_plan: bool) -> None:
        """Called after every step; `on_plan`: the step ran on the plan whose rate is checked (not another shape's)."""
        if self._done:
            return
        if not on_plan:
            self._start = None                          # another plan's steps in the window: start again
            return
        steps, t = self.telemetry.steps, self.telemetry
        if self._start is None:
            if steps >= WINDOW[0]:
                self._start = (steps, t.adam_elems, t.adam_seconds)
        elif steps - self._start[0] >= WINDOW[1] - WINDOW[0]:
            self._conclude(t.adam_elems - self._start[1], t.adam_seconds - self._start[2], self._start[0], steps)

    def _conclude(self, elems: int, seconds: float, after: int, last: int) -> None:
        self._done = True
        if elems <= 0 or seconds <= 0:
            return
        self.measured = elems / seconds
        ratio = self.measured / self.assumed
        said = (f"the host Adam ran at {self.measured / 1e9:.3g} G params/s ({self.state} moments, "
                f"{elems / 1e6:.0f} M params in {seconds:.3g} s over steps {after + 1}-{last}); the plan "
                f"assumed {self.assumed / 1e9:.3g} beside its copies ({self.alone / 1e9:.3g} alone)")
        if abs(ratio - 1.0) <= TOLERANCE:
            log.info("%s: within %d%%", said, round(100 * TOLERANCE))
            return
        if not (self.learns and learning_host_rates()) or self.device.type != "cuda":
            log.info("%s", said)
            return
        # never above the calibration's (the Adam alone at its best): a plan whose copies the share model overprices
        # would otherwise raise it, and the next plan lower it again
        calibrated = calibrated_rates(self.device, self.dtype).host_adam_with(self.state)
        learned = min(self.alone * ratio, calibrated)
        if abs(learned / self.alone - 1.0) <= TOLERANCE:
            log.info("%s (the rate alone it planned with stands: the calibration's is the most learned)", said)
            return
        self.learned = learned
        learn_host_rate(self.device, self.dtype, self.state, self.learned)
        log.info("%s: the next compile on this machine plans with %.3g G params/s alone (PSTAR_FX_LEARN_RATES=0: "
                 "the calibration's)", said, self.learned / 1e9)
