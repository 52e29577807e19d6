"""lr: the learning rate of each update, a pure function of how many updates were applied before it.

Forms (Config.lr_schedule):
  None                 constant: the optimizer's lr.
  a callable           step -> multiplier of the optimizer's lr, as torch.optim.lr_scheduler.LambdaLR.
  {"type": "cosine" | "linear" | "constant", "warmup_steps", "total_steps", "min_lr"}
                       Hugging Face's get_cosine_schedule_with_warmup / get_linear_schedule_with_warmup /
                       get_constant_schedule_with_warmup: warm-up from multiplier 0 at step 0 to 1 at
                       `warmup_steps`, then cosine or linear decay to `min_lr` (an absolute rate, as in
                       get_cosine_with_min_lr_schedule_with_warmup; default 0) at `total_steps`, and
                       `min_lr` after it. "constant" holds the lr after warm-up (no total_steps, no min_lr).

`step` counts applied updates from 0, so the first update uses multiplier(0): 0 with any warm-up.
Skipped steps (non-finite gradients) do not advance it.
"""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")
_KEYS = {"cosine": ("type", "warmup_steps", "total_steps", "min_lr"),
         "linear": ("type", "warmup_steps", "total_steps", "min_lr"),
         "constant": ("type", "warmup_steps")}


def check_schedule(spec):
    """Validate a Config.lr_schedule value; return it normalized (dict with defaults filled in)."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, dict):
        raise TypeError(f"lr_schedule: expected None, a callable step -> multiplier, or a dict with keys "
                        f"{list(_KEYS['cosine'])}, got {spec!r}")
    kind = spec.get("type")
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule.type: {kind!r} is not one of {list(SCHEDULES)}")
    unknown = [k for k in spec if k not in _KEYS[kind]]
    if unknown:
        raise ValueError(f"lr_schedule: unknown key(s) {unknown} for type {kind!r}; valid keys: {list(_KEYS[kind])}")
    out = {"type": kind, "warmup_steps": spec.get("warmup_steps", 0)}
    if kind != "constant":
        if "total_steps" not in spec:
            raise ValueError(f"lr_schedule.total_steps: required for type {kind!r}")
        out["total_steps"] = spec["total_steps"]
        out["min_lr"] = spec.get("min_lr", 0.0)
    for key in ("warmup_steps", "total_steps"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 0):
            raise ValueError(f"lr_schedule.{key}: expected an int >= 0, got {out[key]!r}")
    if "min_lr" in out:
        v = out["min_lr"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"lr_schedule.min_lr: expected a number >= 0, got {v!r}")
        out["min_lr"] = float(v)
    if kind != "constant" and out["total_steps"] < out["warmup_steps"]:
        raise ValueError(f"lr_schedule.total_steps ({out['total_steps']}) is less than warmup_steps "
                         f"({out['warmup_steps']})")
    return out


class LrSchedule:
    def __init__(self, spec, base_lr: float):
        self.spec = check_schedule(spec)
        self.base_lr = base_lr

    def multiplier(self, step: int) -> float:
        spec = self.spec
        if spec is None:
            return 1.0
        if callable(spec):
            return float(spec(step))
        warmup = spec["warmup_steps"]
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if spec["type"] == "constant":
            return 1.0
        total = spec["total_steps"]
        if spec["type"] == "cosine":
            progress = min(1.0, float(step - warmup) / float(max(1, total - warmup)))
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:   # as get_linear_schedule_with_warmup computes it (1 - progress differs in the last bits)
            factor = float(max(0, total - step)) / float(max(1, total - warmup))
        min_rate = spec["min_lr"] / self.base_lr if self.base_lr else 0.0
        return max(0.0, factor * (1.0 - min_rate) + min_rate)

    def lr(self, step: int) -> float:
        return self.base_lr * self.multiplier(step)

