"""adam: the per-chunk Adam / AdamW update with fp32 master weights, and its inverse.

`chunk_update` updates one chunk's master, exp_avg and exp_avg_sq in place, over the spans of parameters
that received gradients (padding and gradient-less parameters are left alone, as torch.optim skips
params whose .grad is None). The kernels (C++ on the host, Triton on the GPU) do the arithmetic.

`chunk_undo` is its inverse: given the state after an update and the gradient that update consumed, it
restores the state before it. The step's transaction uses it to roll back a speculative update (a step
that must be skipped or failed midway) and to correct one (undo, then update again with the clipped
gradient). Undo is exact up to fp32 rounding, not bit for bit: the master is restored to within an ulp
or two, and the moments lose what rounding took from them (exp_avg = (exp_avg' - (1 - b1) g) / b1 in
float64 recovers exp_avg to within half an ulp of exp_avg'). Work runs in blocks of `_UNDO_BLOCK_ELEMS` so
its float64 temporaries stay small on any tier.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pstar_fx.kernels import adam_step

_UNDO_BLOCK_ELEMS = 1 << 21


@dataclass(frozen=True)
class Hyper:
    """One step's optimizer hyperparameters, frozen: every chunk update of the step gets this record."""
    step: int                    # 1-based count of this update, as torch's bias correction uses it
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool              # AdamW (True) or Adam with L2 weight decay (False)
    grad_scale: float = 1.0      # the update uses grad / grad_scale (loss scale, divided by the clip coefficient)

    @staticmethod
    def from_config(opt: dict, *, step: int, lr: float, grad_scale: float = 1.0) -> "Hyper":
        return Hyper(step=step, lr=lr, betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"],
                     decoupled=opt["type"] == "adamw", grad_scale=grad_scale)

    def scaled(self, grad_scale: float) -> "Hyper":
        return replace(self, grad_scale=grad_scale)


def chunk_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 spans: list[tuple[int, int]], hyper: Hyper, *, found_inf: torch.Tensor | None = None,
                 param_out: torch.Tensor | None = None, check_finite: bool = True) -> bool:
    """Adam/AdamW over `spans` of a chunk. Returns False (and changes nothing) on non-finite gradients.

    With `found_inf` (a 1-element float32 tensor on the chunk's device) nothing waits for the device: a
    set flag skips the update, a non-finite gradient sets it, and the return value is True. `param_out`
    (16-bit, chunk-sized) receives the updated weights in the same pass. `check_finite=False` skips the
    non-finite pre-pass when the caller has already checked the gradient (its norm was finite)."""
    beta1, beta2 = hyper.betas
    check = check_finite and len(spans) == 1   # one span: the kernel's own pre-pass keeps it all-or-nothing
    if check_finite and not check:             # several: one verdict for the chunk before any span changes
        bad = torch.stack([~torch.isfinite(grad[off: off + n]).all() for off, n in spans]).any()
        if found_inf is not None:
            found_inf.add_(bad.to(found_inf.dtype))
        elif bool(bad):
            return False
    ok = True
    for off, n in spans:
        sl = slice(off, off + n)
        ok = adam_step(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], step=hyper.step, lr=hyper.lr,
                       beta1=beta1, beta2=beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                       grad_scale=hyper.grad_scale, decoupled_weight_decay=hyper.decoupled, found_inf=found_inf,
                       check_finite=check, param_out=None if param_out is None else param_out[sl]) is not False and ok
    return ok


def _r(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _unscaled(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """grad / grad_scale as the kernels compute it: a multiplication by the reciprocal when that is exact."""
    g = grad.double()
    if grad_scale != 1.0:
        g = g / float(torch.tensor(grad_scale, dtype=torch.float32))
    return _r(g).double()


def chunk_undo(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               spans: list[tuple[int, int]], hyper: Hyper, *, param_out: torch.Tensor | None = None) -> None:
    """Invert `chunk_update(master, grad, exp_avg, exp_avg_sq, spans, hyper)`, in place (see the module doc)."""
    beta1, beta2 = hyper.betas
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731 - the kernels' fp32 coefficients
    step_size = f32(hyper.lr / (1.0 - beta1 ** hyper.step))
    inv_bc2_sqrt = f32(1.0 / math.sqrt(1.0 - beta2 ** hyper.step))
    decay = f32(1.0 - hyper.lr * hyper.weight_decay)
    eps = f32(hyper.eps)
    with torch.no_grad():
        for off, n in spans:
            for start in range(off, off + n, _UNDO_BLOCK_ELEMS):
                sl = slice(start, min(off + n, start + _UNDO_BLOCK_ELEMS))
                p, m, v = master[sl], exp_avg[sl], exp_avg_sq[sl]
                # the update term exactly as the kernel rounded it: each fp32 op done in float64 and rounded
                # (exact for + - * / sqrt), since torch's own fp32 CPU ops may differ from IEEE in the last bit
                denom = _r(_r(_r(v.double().sqrt()).double() * inv_bc2_sqrt).double() + eps)
                step = _r(step_size * _r(m.double() / denom.double()).double())
                p_prev = p.double() + step.double()
                if hyper.decoupled and hyper.weight_decay != 0.0:
                    p_prev = p_prev / decay
                g = _unscaled(grad[sl], hyper.grad_scale)
                if not hyper.decoupled and hyper.weight_decay != 0.0:
                    g = _r(g + _r(f32(hyper.weight_decay) * p_prev.float().double()).double()).double()
                if hyper.step == 1:          # the first update starts from zero moments: restore them exactly
                    m_prev, v_prev = torch.zeros_like(g), torch.zeros_like(g)
                else:                        # m' = b1 m + (1-b1) g, each product rounded as the kernel did
                    m_prev = (m.double() - _r(f32(1.0 - beta1) * g).double()) / beta1 if beta1 > 0 \
                        else torch.zeros_like(g)
                    v_prev = ((v.double() - _r(_r(f32(1.0 - beta2) * g).double() * g).double()) / beta2
                              ).clamp_min(0.0) if beta2 > 0 else torch.zeros_like(g)
                p.copy_(p_prev)
                m.copy_(m_prev)
                v.copy_(v_prev)
                if param_out is not None:
                    param_out[sl].copy_(p)
