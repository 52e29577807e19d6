"""Kernels for pstar_fx: fused Adam/AdamW, fp32 -> 16-bit casts and sums of squares on flat chunks.

    from pstar_fx.kernels import adam_step, adam_undo, cast_, sq_norm, sq_norms, build_info

CPU chunks run the C++ extension built at install time (kernels/csrc, OpenMP + run-time SIMD
dispatch, GIL released), CUDA chunks run Triton (kernels/triton_adam.py, imported only when used),
and plain torch (kernels/torch_adam.py) is the fallback. See kernels/ops.py for the contract.
"""
if __name__ == "kernels":
    # This folder is pstar_fx.kernels. Imported as top-level `kernels`, the checkout's root is on sys.path (python -m
    # pytest, python -c in the checkout) and something asked for the PyPI package of that name (transformers 5.25
    # imports Hugging Face's `kernels` when it is installed): load that one in this module's place, as if the
    # checkout were not on the path.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        raise ImportError("No module named 'kernels' (the PyPI package): this checkout's kernels/ folder is "
                          "pstar_fx.kernels", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module        # what `import kernels` returns once this file has run
    _spec.loader.exec_module(_module)
else:
    from .ops import BACKENDS, adam_step, adam_undo, build_info, cast_, sq_norm, sq_norms

__all__ = ["BACKENDS", "adam_step", "adam_undo", "build_info", "cast_", "sq_norm", "sq_norms"]
