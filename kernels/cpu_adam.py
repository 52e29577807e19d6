"""Thin Python side of the C++ CPU kernels (kernels/csrc/cpu_adam.cpp, built at install time into
pstar_fx.kernels._cpu_adam). Hands the extension data pointers, element counts and dtype names.

Bytes per element (see cpu_adam.cpp): Adam 28 B (read p, m, v 12 B + grad 4 B fp32 / 2 B 16-bit; write p, m, v
12 B; + 2 B for the optional 16-bit param copy; bf16 moments: 20 B + grad; int8 moments: 12 B + grad + 0.06 B of
block scales) + the non-finite check's read of the grad (4 B / 2 B); Adam undo 28 B / 26 B (+ 2 B for the redo's
16-bit copy; the master alone 16 B); cast 6 B; sq_norm 4 B / 2 B; the STREAM triad 12 B counted (read b, c, write a;
a plain store also reads a's line first, which STREAM does not count).

Threads: by default one per physical core this process may run on (`default_threads()`: hyperthread siblings
share a core's load/store buffers and add nothing to a memory-bound loop), or OMP_NUM_THREADS when it is set;
`set_threads(n)` changes that for the calls of one Python thread (the engine's host worker, `worker_threads()`).
"""
from __future__ import annotations

import functools
import os
import threading

import torch

from . import quant8

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "uint8"}


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


@functools.cache
def default_threads() -> int:
    """Threads the kernels use when not told: OMP_NUM_THREADS if set, else the physical cores among the CPUs
    this process may run on (sysfs topology; the CPU count where that cannot be read)."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) <= 1 and os.environ.get("OMP_PROC_BIND", "false").lower() not in ("false", ""):
        cpus = []  # OpenMP bound this thread to one place at start-up: its mask says nothing of the machine's
    cpus = cpus or list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f, open(f"{topo}/core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def worker_threads() -> int:
    """Threads for a host Adam that runs beside a thread launching GPU work (the CUDA runtime's host worker):
    one core fewer than `default_threads()`, left to that thread, unless OMP_NUM_THREADS says otherwise.
    Measured on the H200 box (16 cores), GPT3_18B with bf16 moments, same box and plan: 16 threads 4.53 s a
    step (host Adam 1.56 s, steps 4.44-4.63 s), 15 threads 4.33 s (host Adam 1.38 s, 4.33-4.34 s). With every
    core in the Adam's parallel loop, the launching thread pre-empts one of them and the loop waits for it."""
    n = default_threads()
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return n if (env.isdigit() and int(env) > 0) or n <= 2 else n - 1


_LOCAL = threading.local()


def set_threads(n: int) -> None:
    """The threads of this Python thread's kernel calls that are not told (0: `default_threads()` again)."""
    _LOCAL.threads = max(0, int(n))


def _threads(num_threads: int) -> int:
    return num_threads if num_threads > 0 else (getattr(_LOCAL, "threads", 0) or default_threads())


# How the update pass stores and splits its work, chosen by bench/host_adam_bench.py on the 16-core box:
# see cpu_adam.cpp ("Stores and schedule").
STORES = "stream_out"
SCHEDULE = "dynamic"
PREFETCH_ELEMS = 512


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
              num_threads=0, stores=STORES, schedule=SCHEDULE, prefetch_elems=PREFETCH_ELEMS, exp_avg_absmax=None,
              exp_avg_sq_absmax=None, copy_only=False) -> bool:
    """stores: "plain" or "stream_out" (non-temporal stores for the 16-bit copy); prefetch_elems: software
    prefetch that many elements ahead (> 0 into L1, < 0 into L2, 0 none);
    schedule: "dynamic" (64K-element blocks handed out as threads free up) or "static" (one contiguous share
    per thread, the check reading it backwards so its first blocks are still cached for the update);
    copy_only: write `param_out` alone (fp32 or bf16 moments), the bits the step writes there."""
    return _ext().adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        "" if param_out is None else _DTYPE_NAMES[param_out.dtype],
        param.numel(), int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(decoupled_weight_decay) or weight_decay == 0.0, bool(check_finite), simd,
        _threads(num_threads), stores, schedule, int(prefetch_elems), _DTYPE_NAMES[exp_avg.dtype],
        *_scales(exp_avg, exp_avg_absmax, exp_avg_sq_absmax), bool(copy_only),
    )


@functools.cache
def _q8_layout():
    info = _ext().build_info()
    return info.get("q8_block_elems"), info.get("q8_buckets")


def _scales(exp_avg, exp_avg_absmax, exp_avg_sq_absmax) -> tuple:
    """int8 moments: their scales' pointers and the quantization tables' (CPU tensors that live as long as the
    module, kernels/quant8.py); other moments: none."""
    if exp_avg.dtype != torch.uint8:
        return 0, 0, []
    if _q8_layout() != (quant8.BLOCK_ELEMS, [quant8.BUCKET_MIN_EXP, quant8.BUCKETS_PER_SIGN]):
        raise RuntimeError("the C++ extension was built for another int8 layout (or before int8 moments); "
                           "rebuild it (`pip install -e .`)")
    return exp_avg_absmax.data_ptr(), exp_avg_sq_absmax.data_ptr(), [t.data_ptr() for t in quant8.cpu_tables()]


def adam_undo(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
              decoupled_weight_decay, redo_scale=None, param_out=None, part=0, num_threads=0, simd="auto",
              stores=STORES, prefetch_elems=PREFETCH_ELEMS) -> None:
    """simd, stores, prefetch_elems: as adam_step's (the redo's 16-bit copy is the one non-temporal store).
    Every SIMD level gives the scalar level's bits, which are the pre-vector kernel's (cpu_adam.cpp)."""
    _ext().adam_undo(
        param.data_ptr(), 0 if grad is None else grad.data_ptr(),
        "float32" if grad is None else _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(decoupled_weight_decay) or weight_decay == 0.0,
        0.0 if redo_scale is None else float(redo_scale), 0 if param_out is None else param_out.data_ptr(),
        "" if param_out is None else _DTYPE_NAMES[param_out.dtype], part, _threads(num_threads), simd, stores,
        int(prefetch_elems),
    )


def adam_rescale(param, grad, exp_avg, exp_avg_sq, *, redo_scale, param_out=None, copy_only=False, **kw) -> None:
    """adam_undo's parts 4 (the one-pass fp32 correction) and 5 (its 16-bit copy alone): cpu_adam_impl.h
    rescale_elems. Keywords as adam_undo's."""
    adam_undo(param, grad, exp_avg, exp_avg_sq, redo_scale=redo_scale, param_out=param_out,
              part=5 if copy_only else 4, **kw)


def cast_(dst, src, *, simd="auto", num_threads=0) -> None:
    _ext().cast(dst.data_ptr(), _DTYPE_NAMES[dst.dtype], src.data_ptr(), src.numel(), simd, _threads(num_threads))


def sq_norm(x, *, simd="auto", num_threads=0) -> torch.Tensor:
    total = _ext().sq_sum(x.data_ptr(), _DTYPE_NAMES[x.dtype], x.numel(), simd, _threads(num_threads))
    return torch.tensor(total, dtype=torch.float32)


def sq_norms(x, segments, *, simd="auto", num_threads=0) -> torch.Tensor:
    # sq_sum's float64 total per segment, unrounded; its blocks start at the segment's first element
    ext, name, base, es = _ext(), _DTYPE_NAMES[x.dtype], x.data_ptr(), x.element_size()
    threads = _threads(num_threads)
    return torch.tensor([ext.sq_sum(base + off * es, name, n, simd, threads) for off, n in segments],
                        dtype=torch.float64)


def stream_triad(a, b, c, *, scalar=3.0, reps=5, nt=False, simd="auto", num_threads=0) -> float:
    """STREAM's triad a = b + scalar * c on float32 tensors in the kernels' threads; the best of `reps`
    times in seconds. Bandwidth as STREAM counts it: 12 B per element / time."""
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or t.numel() != a.numel():
            raise ValueError(f"stream_triad: {name} must be a contiguous float32 CPU tensor of a's size")
    return _ext().stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), a.numel(), float(scalar), int(reps),
                               bool(nt), simd, _threads(num_threads))
