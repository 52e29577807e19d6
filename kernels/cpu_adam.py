"""Thin Python side of the C++ CPU kernels (kernels/csrc/cpu_adam.cpp, built at install time into
pstar_fx.kernels._cpu_adam). Hands the extension data pointers, element counts and dtype names.

Bytes per element (see cpu_adam.cpp): Adam undo 26-28 B; Adam 28 B + the 4 B (fp32) / 2 B (16-bit) grad re-read of the
non-finite pre-pass + 2 B for the optional 16-bit param copy; cast 6 B; sq_norm 4 B / 2 B.
"""
from __future__ import annotations

import functools

import torch

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def extension():
    """The compiled module, or the ImportError that says why there is none."""
    try:
        from . import _cpu_adam
    except ImportError as e:
        return e
    return _cpu_adam


def available() -> bool:
    return not isinstance(extension(), ImportError)


def _ext():
    ext = extension()
    if isinstance(ext, ImportError):
        raise RuntimeError(
            "backend='cpp': the C++ extension pstar_fx.kernels._cpu_adam is not built "
            f"({ext}); reinstall with a C++ compiler (`pip install -e .`) or use backend='torch'"
        )
    return ext


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              grad_scale, param_out, decoupled_weight_decay, check_finite=True, simd="auto",
              num_threads=0) -> bool:
    return _ext().adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        "" if param_out is None else _DTYPE_NAMES[param_out.dtype],
        param.numel(), int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(decoupled_weight_decay) or weight_decay == 0.0, bool(check_finite), simd, num_threads,
    )


def adam_undo(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
              decoupled_weight_decay, redo_scale=None, param_out=None, part=0, num_threads=0) -> None:
    _ext().adam_undo(
        param.data_ptr(), 0 if grad is None else grad.data_ptr(),
        "float32" if grad is None else _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(decoupled_weight_decay) or weight_decay == 0.0,
        0.0 if redo_scale is None else float(redo_scale), 0 if param_out is None else param_out.data_ptr(),
        "" if param_out is None else _DTYPE_NAMES[param_out.dtype], part, num_threads,
    )


def cast_(dst, src, *, simd="auto", num_threads=0) -> None:
    _ext().cast(dst.data_ptr(), _DTYPE_NAMES[dst.dtype], src.data_ptr(), src.numel(), simd, num_threads)


def sq_norm(x, *, simd="auto", num_threads=0) -> torch.Tensor:
    total = _ext().sq_sum(x.data_ptr(), _DTYPE_NAMES[x.dtype], x.numel(), simd, num_threads)
    return torch.tensor(total, dtype=torch.float32)


def sq_norms(x, segments, *, simd="auto", num_threads=0) -> torch.Tensor:
    # sq_sum's float64 total per segment, unrounded; its blocks start at the segment's first element
    ext, name, base, es = _ext(), _DTYPE_NAMES[x.dtype], x.data_ptr(), x.element_size()
    return torch.tensor([ext.sq_sum(base + off * es, name, n, simd, num_threads) for off, n in segments],
                        dtype=torch.float64)
