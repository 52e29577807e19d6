"""The kernel contract: adam_step, adam_undo, cast_, sq_norm on flat chunks, with one validation and one
backend choice for all of them.

backend:
  "auto"    CPU tensors -> "cpp" (or "torch" with a one-time warning when the extension is not
            built); CUDA tensors -> "triton" (or "torch" with a one-time warning without triton);
            any other device -> "torch".
  "cpp"     the C++ extension (CPU tensors only).
  "triton"  Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
  "torch"   plain torch ops, any device.
"""
from __future__ import annotations

import functools
import importlib
import math
import numbers
import os
import warnings

import torch

from . import cpu_adam, quant8, torch_adam

BACKENDS = ("auto", "cpp", "triton", "torch")
_FLOAT16 = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bf16: optimizer_state="bf16"; uint8: "int8", codes with per-block scales (quant8.py). Both moments the same dtype.
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


@functools.cache
def _triton():
    """The Triton kernel module (imports triton on first use), or the ImportError."""
    try:
        return importlib.import_module(".triton_adam", __package__)
    except ImportError as e:
        return e


@functools.cache
def _warn_fallback(what: str, why: str) -> None:
    warnings.warn(f"pstar_fx.kernels: {what}; using the pure-torch fallback (slower). Reason: {why}",
                  RuntimeWarning, stacklevel=4)


def _resolve(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cpu":
            if cpu_adam.available():
                return "cpp"
            _warn_fallback("the C++ CPU Adam extension is not built", str(cpu_adam.extension()))
            return "torch"
        if device.type == "cuda":
            mod = _triton()
            if not isinstance(mod, ImportError):
                return "triton"
            _warn_fallback("triton is not importable", str(mod))
        return "torch"
    if backend == "cpp" and device.type != "cpu":
        raise ValueError(f"backend='cpp' needs CPU tensors, got device {device}")
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs CUDA (or interpreted CPU) tensors, got device {device}")
        if isinstance(_triton(), ImportError):
            raise RuntimeError(f"backend='triton': cannot import the Triton kernels ({_triton()})")
    return backend


def _check_tensor(name: str, t, numel: int | None, device: torch.device | None, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (flat chunks)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, param is on {device}")


def _as_float(name: str, value) -> float:
    """A finite Python float from a number or a one-element tensor (reading a CUDA tensor syncs)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              grad_scale=1.0, param_out=None, decoupled_weight_decay=True, backend="auto", found_inf=None,
              check_finite=True, exp_avg_absmax=None, exp_avg_sq_absmax=None, part="all"):
    """One Adam/AdamW step on a flat chunk, in place on fp32 param, exp_avg and exp_avg_sq.

    exp_avg, exp_avg_sq: fp32, or both bf16 (optimizer_state="bf16"): read exactly as fp32, the step computed
    in fp32, written back rounded to nearest even (as .to(torch.bfloat16)); or both uint8 codes
    (optimizer_state="int8", kernels/quant8.py) with their fp32 scales `exp_avg_absmax`, `exp_avg_sq_absmax`
    (one per quant8.BLOCK_ELEMS elements, blocks from the first element): dequantized, the step computed in
    fp32 (the master from the unquantized new moments), the new moments quantized per block. adam_undo refuses
    bf16 and int8 moments.

    grad: fp32, bf16 or fp16; it is divided by `grad_scale` first (loss-scale unscaling).
    param_out: optional bf16/fp16 tensor that receives the updated param (bf16 rounded to nearest even).
    decoupled_weight_decay: True = AdamW (p -= lr*wd*p), False = Adam with L2 (g += wd*p).
    step: 1-based step count after increment, as torch's bias correction uses it.
    Returns True; or False when some grad / grad_scale is inf or NaN, in which case nothing at all
    was written (param, exp_avg, exp_avg_sq, param_out are bit-unchanged).

    Extensions beyond the contract (defaults keep the contract's behaviour):
    found_inf: a 1-element float32 tensor on param's device. The step is skipped when it is already
        nonzero, and it is set to 1 when this grad is non-finite; nothing waits for the device
        (no host sync on CUDA) and the return value is None.
    check_finite=False: skip the non-finite pre-pass (one read of the grad, 4 B/element of ~32) when
        the caller already knows the grads are finite — e.g. a finite sq_norm of the same grads,
        or an overflow check done on the GPU. Non-finite grads are then applied, as torch's own
        optimizers do, and the return value is True.
    part="copy": write only `param_out`, the bits "all" writes there, leaving param and the moments as they are
        (16 B a parameter of memory against 28 with fp32 moments: a step's 16-bit weights first, its state after;
        fp32 or bf16 moments, no found_inf).
    """
    if part not in ("all", "copy"):
        raise ValueError(f"part must be 'all' or 'copy', got {part!r}")
    if part == "copy" and (param_out is None or found_inf is not None or exp_avg.dtype == torch.uint8):
        raise ValueError("part='copy' writes a step's 16-bit copy alone: it needs param_out, no found_inf, and fp32 "
                         "or bf16 moments")
    _check_tensor("param", param, None, None, (torch.float32,))
    n, dev = param.numel(), param.device
    _check_tensor("grad", grad, n, dev, _GRAD_DTYPES)
    _check_tensor("exp_avg", exp_avg, n, dev, _MOMENT_DTYPES)
    _check_tensor("exp_avg_sq", exp_avg_sq, n, dev, (exp_avg.dtype,))
    quantized = exp_avg.dtype == torch.uint8
    if quantized:
        for name, t in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
            if t is None:
                raise ValueError(f"uint8 moments (optimizer_state='int8') need {name}: their per-block scales")
            _check_tensor(name, t, None, dev, (torch.float32,))
            if t.numel() != quant8.blocks(n):
                raise ValueError(f"{name} has {t.numel()} elements; {n} elements in blocks of "
                                 f"{quant8.BLOCK_ELEMS} need {quant8.blocks(n)}")
    elif exp_avg_absmax is not None or exp_avg_sq_absmax is not None:
        raise ValueError("exp_avg_absmax / exp_avg_sq_absmax are the scales of uint8 moments; these are "
                         f"{str(exp_avg.dtype).replace('torch.', '')}")
    if param_out is not None:
        _check_tensor("param_out", param_out, n, dev, _FLOAT16)
    if found_inf is not None:
        _check_tensor("found_inf", found_inf, 1, dev, (torch.float32,))
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, after increment), got {step!r}")
    lr, beta1, beta2, eps, weight_decay, grad_scale = (
        _as_float(name, value) for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                                                    ("weight_decay", weight_decay), ("grad_scale", grad_scale)))
    if not grad_scale > 0:
        raise ValueError(f"grad_scale must be positive and finite, got {grad_scale}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")

    which = _resolve(backend, dev)
    if n > 0 and dev.type != "meta":
        state = [param, exp_avg, exp_avg_sq] + ([exp_avg_absmax, exp_avg_sq_absmax] if quantized else [])
        if len({t.data_ptr() for t in state}) < len(state):
            raise ValueError("param, exp_avg and exp_avg_sq (and their scales) must be distinct memory")
    hyper = dict(step=int(step), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 grad_scale=grad_scale, param_out=param_out,
                 decoupled_weight_decay=bool(decoupled_weight_decay), check_finite=bool(check_finite))
    if quantized:
        hyper.update(exp_avg_absmax=exp_avg_absmax, exp_avg_sq_absmax=exp_avg_sq_absmax)
    if part == "copy" and which != "cpp":          # the other backends step copies of the state
        return adam_step(param.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), backend=backend, **hyper)
    if part == "copy":
        hyper.update(copy_only=True)
    if which == "triton":
        return _triton().adam_step(param, grad, exp_avg, exp_avg_sq, found_inf=found_inf, **hyper)
    if found_inf is not None and bool(found_inf.item() != 0):
        return None
    if n == 0:
        ok = True
    elif which == "cpp":
        ok = cpu_adam.adam_step(param, grad, exp_avg, exp_avg_sq, **hyper)
    elif quantized:
        ok = torch_adam.adam_step_int8(param, grad, exp_avg, exp_avg_sq, **hyper)
    else:
        ok = torch_adam.adam_step(param, grad, exp_avg, exp_avg_sq, **hyper)
    if found_inf is not None:
        if not ok:
            found_inf.fill_(1.0)
        return None
    return ok


def _check_stepped(op: str, done: str, needs: str, exp_avg, exp_avg_sq, param_out, step, n: int, dev) -> None:
    """The fp32 moments, 16-bit copy and 1-based step of a stepped chunk that an undo or a correction reads (bf16 and
    int8 moments are neither: the update rounded or quantized them, which is not invertible)."""
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        kind = {torch.bfloat16: "bf16", torch.uint8: "int8"}.get(exp_avg.dtype, str(exp_avg.dtype))
        raise ValueError(f"{op}: {kind} moments (optimizer_state={kind!r}) cannot be {done}: the update "
                         f"{'rounded' if kind == 'bf16' else 'quantized'} them, which is not invertible; the plan "
                         f"uses a transaction that needs no {needs}")
    _check_tensor("exp_avg", exp_avg, n, dev, (torch.float32,))
    _check_tensor("exp_avg_sq", exp_avg_sq, n, dev, (torch.float32,))
    if param_out is not None:
        _check_tensor("param_out", param_out, n, dev, _FLOAT16)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, after increment), got {step!r}")


def adam_undo(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0,
              decoupled_weight_decay=True, redo_scale=None, param_out=None, part="all", backend="auto") -> None:
    """The inverse of `adam_step` (without `found_inf`): given param, exp_avg and exp_avg_sq after a step and
    the grad that step consumed, restore them to what they were before it, in place. The master comes back
    to within an ulp or two; a moment loses only what rounding took from its updated value (after step 1,
    the moments come back as exact zeros).

    redo_scale: then apply the step again from the restored state with grad / redo_scale (a correction of
    a step that used the wrong scale, e.g. a guessed clip coefficient), in the same pass, writing
    `param_out` (16-bit) too. The result is what `adam_step(..., grad_scale=redo_scale)` gives from the
    restored state. CPU: the C++ kernel; CUDA: Triton; otherwise plain torch (float64 temporaries in blocks).

    part: "all"; "param" (the master only, from the updated moments: `grad` may be None); "moments" (the
    master is already restored: the moments, from the grad, and the redo if asked) — a replayed step's
    two halves, when no gradient was kept; "copy" (a correction's `param_out` alone, the bits "all" writes
    there; param, exp_avg and exp_avg_sq are left as they are: 16 B a parameter against 28). The runtime does not
    use "copy": correcting host chunks' 16-bit copies first and their state after was slower on the H200 (the
    kernel's float64 arithmetic binds before memory, so the split adds work to the busy host worker; bench/RESULTS.md,
    2026-12-03 session 11).
    """
    parts = {"all": 0, "param": 1, "moments": 2, "copy": 3}
    if part not in parts:
        raise ValueError(f"part must be one of {list(parts)}, got {part!r}")
    if part == "param" and (redo_scale is not None or param_out is not None):
        raise ValueError("part='param' restores the master only: no redo_scale, no param_out")
    if part == "copy" and (redo_scale is None or param_out is None):
        raise ValueError("part='copy' writes a correction's 16-bit copy: it needs redo_scale and param_out")
    _check_tensor("param", param, None, None, (torch.float32,))
    n, dev = param.numel(), param.device
    if part != "param" or grad is not None:
        _check_tensor("grad", grad, n, dev, _GRAD_DTYPES)
    _check_stepped("adam_undo", "undone", "undo", exp_avg, exp_avg_sq, param_out, step, n, dev)
    which = _resolve(backend, dev)
    code = parts[part]
    hyper = dict(step=int(step), lr=_as_float("lr", lr), beta1=_as_float("beta1", beta1),
                 beta2=_as_float("beta2", beta2), eps=_as_float("eps", eps),
                 weight_decay=_as_float("weight_decay", weight_decay), grad_scale=_as_float("grad_scale", grad_scale),
                 decoupled_weight_decay=bool(decoupled_weight_decay))
    if redo_scale is not None and not _as_float("redo_scale", redo_scale) > 0:
        raise ValueError(f"redo_scale must be positive, got {redo_scale}")
    if n == 0:
        return
    if part == "copy" and which != "cpp":          # the other backends correct copies of the state
        adam_undo(param.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), **hyper, redo_scale=redo_scale,
                  param_out=param_out, backend=backend)
    elif which == "cpp":
        cpu_adam.adam_undo(param, grad, exp_avg, exp_avg_sq, redo_scale=redo_scale, param_out=param_out, part=code,
                           **hyper)
    elif which == "triton" and hyper["beta1"] > 0 and hyper["beta2"] > 0:
        _triton().adam_undo(param, grad, exp_avg, exp_avg_sq, redo_scale=redo_scale, param_out=param_out, part=code,
                            **hyper)
    else:
        torch_adam.adam_undo(param, grad, exp_avg, exp_avg_sq, part=code, **hyper)
        if redo_scale is not None:
            adam_step(param, grad, exp_avg, exp_avg_sq, **dict(hyper, grad_scale=redo_scale), param_out=param_out,
                      check_finite=False, backend=backend)


def adam_rescale(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0,
                 redo_scale, decoupled_weight_decay=True, param_out=None, part="all", backend="auto") -> None:
    """Correct a step that `adam_step(..., grad_scale=grad_scale)` made (a speculated update with a guessed clip
    coefficient) to the step with grad / redo_scale, in place, in one fp32 pass over the updated state: no undo,
    no float64 (see cpu_adam_impl.h rescale_elems for the arithmetic). Against the step made afresh from the state
    before it, the master lands within two ulps of the larger of it and the update term, plus what the moments'
    rounding moves the update term by (tests/test_kernels.py holds that bound; the undo-then-redo,
    `adam_undo(..., redo_scale=...)`, exceeded it by up to 1.34x with AdamW's decay), and the moments carry their
    updated values' rounding as an absolute error, as the undo's restored moments do; the memory moved is the same (28 B a parameter with
    16-bit grads and a 16-bit copy), the arithmetic a fraction (two divide + sqrt pairs and ~14 fp32 operations,
    where the undo-then-redo adds ~60 float64 operations). Every backend gives the same bits (the GPU's compiler
    may fuse multiply-adds there).

    part: "all", or "copy" (only `param_out`, the bits "all" writes there; param and moments are left as they
    are: 16 B a parameter).
    """
    if part not in ("all", "copy"):
        raise ValueError(f"part must be 'all' or 'copy', got {part!r}")
    if part == "copy" and param_out is None:
        raise ValueError("part='copy' writes the corrected 16-bit copy: it needs param_out")
    _check_tensor("param", param, None, None, (torch.float32,))
    n, dev = param.numel(), param.device
    _check_tensor("grad", grad, n, dev, _GRAD_DTYPES)
    _check_stepped("adam_rescale", "corrected", "correction", exp_avg, exp_avg_sq, param_out, step, n, dev)
    if not _as_float("redo_scale", redo_scale) > 0:
        raise ValueError(f"redo_scale must be positive, got {redo_scale}")
    hyper = dict(step=int(step), lr=_as_float("lr", lr), beta1=_as_float("beta1", beta1),
                 beta2=_as_float("beta2", beta2), eps=_as_float("eps", eps),
                 weight_decay=_as_float("weight_decay", weight_decay), grad_scale=_as_float("grad_scale", grad_scale),
                 decoupled_weight_decay=bool(decoupled_weight_decay), redo_scale=float(redo_scale))
    if n == 0:
        return
    copy_only = part == "copy"
    which = _resolve(backend, dev)
    if which == "cpp":
        cpu_adam.adam_rescale(param, grad, exp_avg, exp_avg_sq, param_out=param_out, copy_only=copy_only, **hyper)
    elif which == "triton":
        _triton().adam_rescale(param, grad, exp_avg, exp_avg_sq, param_out=param_out, copy_only=copy_only, **hyper)
    else:
        torch_adam.adam_rescale(param, grad, exp_avg, exp_avg_sq, param_out=param_out, copy_only=copy_only, **hyper)


def cast_(dst, src, *, backend="auto") -> None:
    """dst <- src: fp32 -> bf16/fp16 rounded to nearest even (NaN stays NaN), or a same-dtype copy."""
    _check_tensor("src", src, None, None, _GRAD_DTYPES)
    _check_tensor("dst", dst, src.numel(), src.device, _GRAD_DTYPES)
    if dst.dtype != src.dtype and not (src.dtype == torch.float32 and dst.dtype in _FLOAT16):
        raise TypeError(f"cast_ converts float32 -> bfloat16/float16 or copies one dtype; "
                        f"got {src.dtype} -> {dst.dtype}")
    which = _resolve(backend, src.device)
    if dst.dtype == src.dtype or src.numel() == 0:
        with torch.no_grad():
            dst.copy_(src)
    elif which == "cpp":
        cpu_adam.cast_(dst, src)
    elif which == "triton":
        _triton().cast_(dst, src)
    else:
        torch_adam.cast_(dst, src)


def sq_norm(x, *, backend="auto") -> torch.Tensor:
    """Sum of squares of x (fp32/bf16/fp16) as a 0-d float32 tensor on x's device; with the C++
    backend the sum is accumulated in float64, with Triton per-block fp32 partials summed in float64."""
    _check_tensor("x", x, None, None, _GRAD_DTYPES)
    which = _resolve(backend, x.device)
    if which == "cpp":
        return cpu_adam.sq_norm(x)
    if which == "triton":
        return _triton().sq_norm(x)
    return torch_adam.sq_norm(x)


def sq_norms(x, segments, *, backend="auto") -> torch.Tensor:
    """Sum of squares of each (offset, numel) segment of flat x, as a float64 vector on x's device (one
    entry per segment, no host sync on CUDA).

    Each entry is a function of its segment's elements alone: not of where the segment lies in x (its
    alignment), nor of its neighbours — so a parameter's squared gradient norm has the same bits whatever
    chunk, offset or tier holds it, for one backend. The C++ backend sums in float64 in fixed
    64K-element blocks taken in order (the same bits at every thread count); Triton takes fp32 partials
    per block, compiled without alignment specialization, summed in float64; torch sums float64 squares."""
    _check_tensor("x", x, None, None, _GRAD_DTYPES)
    which = _resolve(backend, x.device)
    for off, n in segments:
        if off < 0 or n < 0 or off + n > x.numel():
            raise ValueError(f"segment ({off}, {n}) lies outside x ({x.numel()} elements)")
    if which == "cpp":
        return cpu_adam.sq_norms(x, segments)
    if which == "triton":
        return _triton().sq_norms(x, segments)
    return torch_adam.sq_norms(x, segments)


def build_info() -> dict:
    """Which kernels this install has: the C++ extension's SIMD level, OpenMP threads and flags
    (or why it is missing). Does not import triton."""
    ext = cpu_adam.extension()
    if isinstance(ext, ImportError):
        return {"cpu_adam": None, "cpu_adam_error": str(ext)}
    return {"cpu_adam": ext.build_info()}
