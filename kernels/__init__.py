"""Kernels for pstar_fx: fused Adam/AdamW, fp32 -> 16-bit casts and sums of squares on flat chunks.

    from pstar_fx.kernels import adam_step, adam_undo, cast_, sq_norm, sq_norms, build_info

CPU chunks run the C++ extension built at install time (kernels/csrc, OpenMP + run-time SIMD
dispatch, GIL released), CUDA chunks run Triton (kernels/triton_adam.py, imported only when used),
and plain torch (kernels/torch_adam.py) is the fallback. See kernels/ops.py for the contract.
"""
from .ops import BACKENDS, adam_step, adam_undo, build_info, cast_, sq_norm, sq_norms

__all__ = ["BACKENDS", "adam_step", "adam_undo", "build_info", "cast_", "sq_norm", "sq_norms"]
