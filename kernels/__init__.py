"""Kernels for pstar_fx: C++ CPU Adam, Triton GPU Adam and casts, pure-torch fallback."""
