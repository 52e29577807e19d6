"""Pure-torch Adam/AdamW, cast and sum of squares: the fallback when the C++ extension is missing,
and backend="torch" on any device.

The Adam update is torch.optim.AdamW's (and Adam's) single-tensor arithmetic, op for op, so on
fp32 grads it gives the same bits as torch.optim.AdamW(foreach=False, fused=False).

Bytes per element: each torch op is its own pass over memory, so with fp32 grads this moves about
90 B/element (isfinite+all, mul, lerp, mul, addcmul, sqrt, div, add, addcdiv) against the fused
kernels' 32 B; unscaling, 16-bit grads and the 16-bit param copy add passes of their own.
"""
from __future__ import annotations

import numpy as np
import torch

from . import quant8


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              grad_scale, param_out, decoupled_weight_decay, check_finite=True) -> bool:
    with torch.no_grad():
        g = grad if grad.dtype == torch.float32 else grad.float()
        if grad_scale != 1.0:
            g = g / grad_scale
        # Checked on the unscaled grad, before anything is written: a failed check changes nothing.
        if check_finite and not bool(torch.isfinite(g).all()):
            return False
        if weight_decay != 0.0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                g = g.add(param, alpha=weight_decay)
        # bf16 moments (optimizer_state="bf16"): the step in fp32 on exact fp32 copies, written back rounded
        # to nearest even
        m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
        v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(m, denom, value=-(lr / bias_correction1))
        if m is not exp_avg:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
        if param_out is not None:
            param_out.copy_(param)
    return True


def adam_step_int8(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, *, step, lr, beta1, beta2,
                   eps, weight_decay, grad_scale, param_out, decoupled_weight_decay, check_finite=True,
                   block_elems: int = 1 << 20) -> bool:
    """Adam/AdamW with int8 moments (optimizer_state="int8", kernels/quant8.py): each moment dequantized to fp32,
    the step computed in the C++ kernel's order (adam_elems: b1*m + (1-b1)*g, not torch's lerp; sqrt(v) times
    1/sqrt(1-b2^t); every coefficient rounded to fp32 as the kernel rounds it; sqrt and / IEEE-rounded, through
    float64), the master updated from the unquantized new moments, which are then quantized per block. It is the
    reference the C++ and Triton kernels equal bit for bit. In pieces of `block_elems` (a multiple of the
    quantization block), so the float64 temporaries stay small."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - a coefficient as the kernels round it
    decay, l2_wd, b1, omb1 = f32(1.0 - lr * weight_decay), f32(weight_decay), f32(beta1), f32(1.0 - beta1)
    b2, omb2, eps32 = f32(beta2), f32(1.0 - beta2), f32(eps)
    inv_bc2_sqrt = f32(1.0 / (1.0 - beta2 ** step) ** 0.5)
    step_size = f32(lr / (1.0 - beta1 ** step))
    scale = f32(grad_scale)
    decoupled = decoupled_weight_decay or weight_decay == 0.0
    with torch.no_grad():
        if check_finite:
            g = grad if grad.dtype == torch.float32 else grad.float()
            if not bool(torch.isfinite(g / scale).all()):
                return False
        assert block_elems % quant8.BLOCK_ELEMS == 0
        for start in range(0, param.numel(), block_elems):
            sl = slice(start, start + block_elems)
            bl = slice(start // quant8.BLOCK_ELEMS, quant8.blocks(min(param.numel(), start + block_elems)))
            g = grad[sl].float()
            if scale != 1.0:
                g = g / scale      # a power of two divides as exactly as the kernel's multiply by its reciprocal
            p = param[sl]
            m = quant8.dequantize(exp_avg[sl], exp_avg_absmax[bl], signed=True)
            v = quant8.dequantize(exp_avg_sq[sl], exp_avg_sq_absmax[bl], signed=False)
            if decoupled:
                p = p * decay
            else:
                g = g + l2_wd * p
            m = b1 * m + omb1 * g
            v = b2 * v + (omb2 * g) * g
            denom = torch.sqrt(v.double()).float() * inv_bc2_sqrt + eps32
            param[sl] = p - step_size * (m.double() / denom.double()).float()
            exp_avg[sl], exp_avg_absmax[bl] = quant8.quantize(m, signed=True)
            exp_avg_sq[sl], exp_avg_sq_absmax[bl] = quant8.quantize(v, signed=False)
        if param_out is not None:
            param_out.copy_(param)
    return True


def adam_undo(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
              decoupled_weight_decay, part: int = 0, block_elems: int = 1 << 20) -> None:
    """The inverse of adam_step given the grad it consumed, as the C++ kernel computes it: each fp32 op of
    the update term redone in float64 and rounded (exact for + - * / sqrt; torch's own fp32 CPU ops may
    differ from IEEE in the last bit), the subtractions undone in float64. In blocks, so the float64
    temporaries stay small on any device."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731 - the kernels' fp32 coefficients
    r = lambda x: x.float().double()  # noqa: E731 - round to fp32, go on in float64
    step_size = f32(lr / (1.0 - beta1 ** step))
    inv_bc2_sqrt = f32(1.0 / (1.0 - beta2 ** step) ** 0.5)
    decay, eps32, b1, b2 = f32(1.0 - lr * weight_decay), f32(eps), f32(beta1), f32(beta2)
    omb1, omb2, wd = f32(1.0 - beta1), f32(1.0 - beta2), f32(weight_decay)
    scale = f32(grad_scale)
    decoupled = decoupled_weight_decay or weight_decay == 0.0
    with torch.no_grad():
        for start in range(0, param.numel(), block_elems):
            sl = slice(start, start + block_elems)
            p, m, v = param[sl], exp_avg[sl], exp_avg_sq[sl]
            if part == 2:                            # the master is already restored
                p0 = p.double()
            else:
                denom = r(r(r(v.double().sqrt()) * inv_bc2_sqrt) + eps32)
                u = r(step_size * r(m.double() / denom))
                p0 = p.double() + u
                p0 = r(p0 / decay) if decoupled else r(p0)
            if part == 1:
                p.copy_(p0)
                continue
            g = grad[sl].double()
            g = g if scale == 1.0 else r(g / scale)
            if not decoupled:
                g = r(g + r(wd * p0))
            if step == 1:                        # the first update starts from zero moments
                m0, v0 = torch.zeros_like(g), torch.zeros_like(g)
            else:
                m0 = (m.double() - r(omb1 * g)) / b1 if b1 > 0 else torch.zeros_like(g)
                v0 = ((v.double() - r(r(omb2 * g) * g)) / b2).clamp_min(0.0) if b2 > 0 else torch.zeros_like(g)
            p.copy_(p0)
            m.copy_(m0)
            v.copy_(v0)


def adam_rescale(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                 decoupled_weight_decay, redo_scale, param_out=None, copy_only=False,
                 block_elems: int = 1 << 20) -> None:
    """A correction in one fp32 pass, as the C++ kernel computes it (cpu_adam_impl.h rescale_elems): each fp32
    op through float64 and rounded (exact for + - * / sqrt), in its order. In blocks, so the temporaries stay
    small on any device."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - the kernels' fp32 coefficients
    r = lambda x: x.float().double()  # noqa: E731 - round to fp32, go on in float64
    step_size = f32(lr / (1.0 - beta1 ** step))
    inv_bc2_sqrt = f32(1.0 / (1.0 - beta2 ** step) ** 0.5)
    eps32, b1, b2 = f32(eps), f32(beta1), f32(beta2)
    omb1, omb2, wd = f32(1.0 - beta1), f32(1.0 - beta2), f32(weight_decay)
    decoupled = decoupled_weight_decay or weight_decay == 0.0

    def unscaled(g, scale):   # the kernel's multiply by an exact reciprocal is this quotient, rounded alike
        return g if f32(scale) == 1.0 else r(g / f32(scale))

    def term(m, v):
        return r(step_size * r(m / r(r(r(v.sqrt()) * inv_bc2_sqrt) + eps32)))

    with torch.no_grad():
        for start in range(0, param.numel(), block_elems):
            sl = slice(start, start + block_elems)
            p1, m1, v1 = param[sl].double(), exp_avg[sl].double(), exp_avg_sq[sl].double()
            g = grad[sl].double()
            gs, gr = unscaled(g, grad_scale), unscaled(g, redo_scale)
            u1 = term(m1, v1)
            if not decoupled:
                wp = r(wd * r(p1 + u1))
                gs, gr = r(gs + wp), r(gr + wp)
            if step == 1:
                m2 = r(r(b1 * torch.zeros_like(g)) + r(omb1 * gr))
                v2 = r(r(b2 * torch.zeros_like(g)) + r(r(omb2 * gr) * gr))
            else:
                m2 = r(r(m1 - r(omb1 * gs)) + r(omb1 * gr))
                b2v0 = r(v1 - r(r(omb2 * gs) * gs))
                b2v0 = torch.where(b2v0 > 0.0, b2v0, torch.zeros_like(b2v0))   # max(x, +0) as maxps: +0 for -0, NaN
                v2 = r(b2v0 + r(r(omb2 * gr) * gr))
            p2 = r(p1 + r(u1 - term(m2, v2)))
            if param_out is not None:
                param_out[sl].copy_(p2)
            if not copy_only:
                param[sl].copy_(p2)
                exp_avg[sl].copy_(m2)
                exp_avg_sq[sl].copy_(v2)


def cast_(dst, src) -> None:
    with torch.no_grad():
        dst.copy_(src)  # torch rounds fp32 -> bf16/fp16 to nearest even


def sq_norms(x, segments) -> torch.Tensor:
    with torch.no_grad():
        flat = x.reshape(-1)
        out = [torch.sum(flat[off:off + n].double().square(), dtype=torch.float64) for off, n in segments]
        return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64, device=x.device)


def sq_norm(x, block_elems: int = 1 << 20) -> torch.Tensor:
    # In blocks, to bound the temporary fp32 copy; each block's squares summed in float64.
    # (torch.linalg.vector_norm(x, dtype=torch.float32) on bf16 input was off by 2e-5 relative.)
    with torch.no_grad():
        flat = x.reshape(-1)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for start in range(0, flat.numel(), block_elems):
            block = flat[start:start + block_elems].float()
            total += torch.sum(block * block, dtype=torch.float64)
        return total.to(torch.float32)
