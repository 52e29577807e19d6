"""adam: the per-chunk Adam / AdamW update with fp32 master weights, and its inverse.

`chunk_update` updates one chunk's master, exp_avg and exp_avg_sq in place, over the spans of parameters
that received gradients (padding and gradient-less parameters are left alone, as torch.optim skips
params whose .grad is None). The kernels (C++ on the host, Triton on the GPU) do the arithmetic.

`chunk_undo` is its inverse: given the state after an update and the gradient that update consumed, it
restores the state before it. The step's transaction uses it to roll back a speculative update (a step
that must be skipped or failed midway) and to correct one (undo, then update again with the clipped
gradient). Undo is exact up to fp32 rounding, not bit for bit: the master is restored to within an ulp
or two, and the moments lose what rounding took from them (exp_avg = (exp_avg' - (1 - b1) g) / b1 in
float64 recovers exp_avg to within half an ulp of exp_avg'; after the first update they come back as
exact zeros). A replay restores the master and the moments in two halves. The kernels
(`pstar_fx.kernels.adam_undo`) do the arithmetic.

`chunk_rescale` corrects an update (a speculated one, made with a guessed clip coefficient) to the update with
another grad_scale, in one fp32 pass from the updated state (`pstar_fx.kernels.adam_rescale`: no undo, no float64,
within the restore contract's two ulps of the update made afresh).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pstar_fx.kernels import adam_rescale, adam_step, adam_undo, cast_, quant8


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
                 param_out: torch.Tensor | None = None, check_finite: bool = True,
                 absmax: tuple[torch.Tensor, torch.Tensor] | None = None, copy_only: bool = False) -> bool:
    """Adam/AdamW over `spans` of a chunk. Returns False (and changes nothing) on non-finite gradients.

    int8 moments (uint8 codes): `absmax` holds the chunk's block scales (exp_avg's, exp_avg_sq's), and `spans`
    are one per parameter (Chunk.param_spans): each span is quantized in blocks from its first element, its
    scales following the previous span's (the store's layout of them).

    With `found_inf` (a 1-element float32 tensor on the chunk's device) nothing waits for the device: a
    set flag skips the update, a non-finite gradient sets it, and the return value is True. `param_out`
    (16-bit, chunk-sized) receives the updated weights in the same pass. `check_finite=False` skips the
    non-finite pre-pass when the caller has already checked the gradient (its norm was finite). `copy_only`: write
    `param_out` alone, the updated weights, leaving the master and moments as they are (fp32 or bf16 moments)."""
    beta1, beta2 = hyper.betas
    check = check_finite and len(spans) == 1   # one span: the kernel's own pre-pass keeps it all-or-nothing
    if check_finite and not check:             # several: one verdict for the chunk before any span changes
        bad = torch.stack([~torch.isfinite(grad[off: off + n]).all() for off, n in spans]).any()
        if found_inf is not None:
            found_inf.add_(bad.to(found_inf.dtype))
        elif bool(bad):
            return False
    ok, at = True, 0
    for off, n in spans:
        sl = slice(off, off + n)
        scales = {}
        if absmax is not None:
            blocks = slice(at, at + quant8.blocks(n))
            scales = dict(exp_avg_absmax=absmax[0][blocks], exp_avg_sq_absmax=absmax[1][blocks])
            at = blocks.stop
        ok = adam_step(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], step=hyper.step, lr=hyper.lr,
                       beta1=beta1, beta2=beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                       grad_scale=hyper.grad_scale, decoupled_weight_decay=hyper.decoupled, found_inf=found_inf,
                       check_finite=check, param_out=None if param_out is None else param_out[sl],
                       part="copy" if copy_only else "all", **scales) is not False and ok
    return ok


def chunk_rescale(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  spans: list[tuple[int, int]], hyper: Hyper, redo: Hyper, *,
                  param_out: torch.Tensor | None = None, copy_only: bool = False) -> None:
    """Make `chunk_update(master, grad, exp_avg, exp_avg_sq, spans, hyper)`, already applied, the update with
    `redo`'s grad_scale instead (a correction), in place and in one pass, writing `param_out` (16-bit) too.
    `copy_only`: write only `param_out`, the bits the correction writes there (the state is left as it is)."""
    if copy_only and param_out is None:
        raise ValueError("copy_only writes the corrected 16-bit copy: it needs param_out")
    if replace(redo, grad_scale=hyper.grad_scale) != hyper:
        raise ValueError("a correction may change only grad_scale")
    beta1, beta2 = hyper.betas
    for off, n in spans:
        sl = slice(off, off + n)
        adam_rescale(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], step=hyper.step, lr=hyper.lr, beta1=beta1,
                     beta2=beta2, eps=hyper.eps, weight_decay=hyper.weight_decay, grad_scale=hyper.grad_scale,
                     redo_scale=redo.grad_scale, decoupled_weight_decay=hyper.decoupled,
                     param_out=None if param_out is None else param_out[sl], part="copy" if copy_only else "all")


def chunk_undo(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               spans: list[tuple[int, int]], hyper: Hyper, *, redo: Hyper | None = None,
               param_out: torch.Tensor | None = None, part: str = "all") -> None:
    """Invert `chunk_update(master, grad, exp_avg, exp_avg_sq, spans, hyper)`, in place (see the module doc).
    With `redo` (the same step with another grad_scale), apply that update in the same pass: a correction.
    `part` "param" restores only the master (no grad needed), "moments" only the moments (the master was
    restored): the two halves of a replayed step; "copy" writes only a correction's `param_out` (the bits
    "all" writes there), leaving the state as it is (kernels/ops.py adam_undo)."""
    beta1, beta2 = hyper.betas
    if redo is not None and replace(redo, grad_scale=hyper.grad_scale) != hyper:
        raise ValueError("a redo may change only grad_scale")
    for off, n in spans:
        sl = slice(off, off + n)
        adam_undo(master[sl], None if grad is None else grad[sl], exp_avg[sl], exp_avg_sq[sl], step=hyper.step,
                  lr=hyper.lr, beta1=beta1, beta2=beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                  grad_scale=hyper.grad_scale,
                  decoupled_weight_decay=hyper.decoupled, redo_scale=None if redo is None else redo.grad_scale,
                  param_out=None if (param_out is None or redo is None) else param_out[sl], part=part)
        if param_out is not None and redo is None:
            cast_(param_out[sl], master[sl])
