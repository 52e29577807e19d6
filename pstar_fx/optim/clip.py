"""clip: the global-norm clip coefficient, with torch.nn.utils.clip_grad_norm_'s arithmetic.

torch computes the total norm in fp32 and multiplies every gradient by
min(1, max_norm / (total_norm + 1e-6)) — also when that is exactly 1. The engine measures each parameter's
sum of squares in float64 and adds them exactly (runtime/verdict.py), so the total norm equals torch's to
fp32 rounding, and has the same bits at any chunk size or placement: the coefficient, hence a clipped
update, does not depend on how the model was laid out.
"""
from __future__ import annotations

import math

import torch


def clip_coefficient(sq_sum: float, max_norm: float | None) -> tuple[float, float]:
    """(total norm, clip coefficient) for a sum of squared gradient entries. Without `max_norm` the
    coefficient is 1.0. A non-finite sum gives a non-finite norm (the step is then skipped, not clipped)."""
    norm = torch.tensor(math.sqrt(sq_sum) if sq_sum >= 0 else float("nan"), dtype=torch.float32)
    if max_norm is None or not torch.isfinite(norm):
        return float(norm), 1.0
    coef = torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (norm + 1e-6), max=1.0)
    return float(norm), float(coef)
