"""Builds pstar_fx.kernels._cpu_adam (kernels/csrc/cpu_adam.cpp) at install time.

`pip install .` and `pip install -e .` compile it; nothing is compiled at run time. The extension is
optional: without a C++ compiler (or without pybind11 at build time) the install still succeeds and
pstar_fx.kernels falls back to pure torch, with a warning.

The build always recompiles (force=True): setuptools otherwise reuses a stale object from build/
when only flags changed, since it compares timestamps of sources alone.
"""
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

# One build for every x86-64: the SIMD level is chosen at run time (see cpu_adam.cpp), so no -march.
# -ffp-contract=off keeps the AVX-512, AVX2 and scalar levels bit-identical (no FMA contraction);
# -fno-math-errno lets sqrtf vectorise without changing any result.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden"]


class AlwaysRebuild(build_ext):
    def finalize_options(self):
        super().finalize_options()
        self.force = True


def extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        print("pstar_fx: pybind11 not found at build time; skipping the C++ CPU Adam "
              "(torch fallback will be used)", file=sys.stderr)
        return []
    flags = " ".join(CXX_FLAGS)
    return [
        Pybind11Extension(
            "pstar_fx.kernels._cpu_adam",
            ["kernels/csrc/cpu_adam.cpp"],
            depends=["kernels/csrc/cpu_adam_impl.h"],
            cxx_std=17,
            extra_compile_args=CXX_FLAGS,
            extra_link_args=["-fopenmp"],
            define_macros=[("PSTAR_BUILD_FLAGS", '"' + flags + '"')],
            optional=True,
        )
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": AlwaysRebuild})
