"""Kernels for pstar_fx: fused Adam/AdamW, fp32 -> 16-bit casts and sums of squares on flat chunks.

    from pstar_fx.kernels import adam_step, adam_undo, cast_, sq_norm, sq_norms, build_info

CPU chunks run the C++ extension built at install time (kernels/csrc, OpenMP + run-time SIMD
dispatch, GIL released), CUDA chunks run Triton (kernels/triton_adam.py, imported only when used),
and plain torch (kernels/torch_adam.py) is the fallback. See kernels/ops.py for the contract.
"""


def _hub_kernels():
    """The PyPI package named `kernels` (Hugging Face's), found on sys.path without this checkout's root, or None.

    This folder is pstar_fx.kernels; it is importable as top-level `kernels` only by accident, when a checkout's
    root is on sys.path (python -m pytest, a bench script). transformers 5.25 imports Hugging Face's `kernels`
    whenever that distribution is installed, and would get this folder instead."""
    import importlib.machinery
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    return importlib.machinery.PathFinder.find_spec("kernels", path)


if __name__ == "kernels" and (_spec := _hub_kernels()) is not None:
    import importlib.util as _util
    import sys as _sys

    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module        # what `import kernels` returns once this file has run
    _spec.loader.exec_module(_module)
else:
    from .ops import BACKENDS, adam_rescale, adam_step, adam_undo, build_info, cast_, sq_norm, sq_norms

    __all__ = ["BACKENDS", "adam_rescale", "adam_step", "adam_undo", "build_info", "cast_", "sq_norm", "sq_norms"]
