"""optim: the per-chunk optimizer update (Adam / AdamW with fp32 master weights).

One call updates one chunk's master, exp_avg and exp_avg_sq in place, over the spans of parameters that
received gradients (padding and gradient-less parameters are left alone, as torch.optim skips params
whose .grad is None). The kernels (C++ on the host, Triton on the GPU) do the arithmetic.

Hooks for what comes next, so it fits without a rewrite: `step` and the hyperparameters are read per
call (an lr schedule changes `hparams["lr"]` between steps); `grad_scale` unscales fp16 loss scaling;
gradient accumulation only delays the call; exact global-norm clipping scales via `grad_scale` once the
norm of the whole gradient is known.
"""
from __future__ import annotations

import torch

from pstar_fx.kernels import adam_step


def chunk_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 spans: list[tuple[int, int]], *, step: int, hparams: dict, grad_scale: float = 1.0,
                 found_inf: torch.Tensor | None = None, param_out: torch.Tensor | None = None) -> bool:
    """Adam/AdamW over `spans` of a chunk. Returns False (and changes nothing) on non-finite gradients.

    With `found_inf` (a 1-element device tensor) nothing waits for the device: a non-finite gradient
    sets the flag and later updates skip; the return value is then True. `param_out` (16-bit, chunk-sized)
    receives the updated weights in the same pass."""
    beta1, beta2 = hparams["betas"]
    check = len(spans) == 1          # one span: the kernel's own pre-pass keeps it all-or-nothing
    if not check:                    # several: one verdict for the whole chunk before any span changes
        bad = torch.stack([~torch.isfinite(grad[off: off + n]).all() for off, n in spans]).any()
        if found_inf is not None:
            found_inf.add_(bad.to(found_inf.dtype))
        elif bool(bad):
            return False
    ok = True
    for off, n in spans:
        sl = slice(off, off + n)
        ok = adam_step(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], step=step, lr=hparams["lr"],
                  beta1=beta1, beta2=beta2, eps=hparams["eps"], weight_decay=hparams["weight_decay"],
                  grad_scale=grad_scale, decoupled_weight_decay=hparams["type"] == "adamw",
                  found_inf=found_inf, check_finite=check,
                  param_out=None if param_out is None else param_out[sl]) is not False and ok
    return ok
