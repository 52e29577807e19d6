"""loss_scale: static or dynamic loss scaling, with torch.amp.GradScaler's rules.

Dynamic: start at `init_scale` (2**16); after `growth_interval` (2000) steps in a row without a non-finite
gradient, multiply by `growth_factor` (2); on a non-finite gradient skip the step and multiply by
`backoff_factor` (0.5). The scale is kept as an fp32 value, as GradScaler keeps it.
"""
from __future__ import annotations

import math

import torch

DYNAMIC_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


class LossScaler:
    """`scale` multiplies the loss (the backward's seed); `update(found_inf)` after each step."""

    def __init__(self, spec):
        self.dynamic = isinstance(spec, dict)
        if self.dynamic:
            self.rules = dict(DYNAMIC_DEFAULTS, **spec)
            self.scale = _f32(self.rules["init_scale"])
        else:
            self.rules = {}
            self.scale = 1.0 if spec is None else _f32(spec)
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale = _f32(self.scale * self.rules["backoff_factor"])
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.rules["growth_interval"]:
            grown = _f32(self.scale * self.rules["growth_factor"])
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """What `state_dict` gave; missing keys keep the current values."""
        self.scale = float(state.get("scale", self.scale))
        self.growth_tracker = int(state.get("growth_tracker", self.growth_tracker))


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))
